"""Rendering console pages: Jinja2 templates, security headers, and htmx fragments.

An htmx request (`HX-Request`) gets only the fragment it asked for, so a form's answer
replaces its own panel; a plain request gets the whole page. Either way the server renders
the form's errors inline.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.responses import HTMLResponse
from starlette.templating import Jinja2Templates

from billing.money import usd

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATE_DIR = PACKAGE_DIR / "templates"
STATIC_DIR = PACKAGE_DIR / "static"
# Pages may hold a freshly created API key: never cached, never framed, scripts only ours.
PAGE_HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


@cache
def static_version(name: str) -> str:
    """A short hash of a static file, put in its URL so a long cache never serves a stale
    copy after an upgrade. Read once per file per process."""
    return hashlib.sha256((STATIC_DIR / name).read_bytes()).hexdigest()[:12]


def static_url(name: str) -> str:
    return f"/console/static/{name}?v={static_version(name)}"


def money(micros: int | None) -> str:
    """Integer micro-USD as dollars: exact, trailing zeros trimmed to cents."""
    if micros is None:
        return "—"
    text = usd(micros)
    whole, _, frac = text.partition(".")
    frac = frac.rstrip("0").ljust(2, "0")
    return f"${whole}.{frac}"


def percent(rate: float | None) -> str:
    return "—" if rate is None else f"{rate * 100:.1f}%"


def when(value: datetime | None) -> str:
    return "—" if value is None else value.strftime("%Y-%m-%d %H:%M UTC")


def size(count: int | None) -> str:
    """A file size for people: bytes up to 1 KiB, then KiB, MiB, GiB with one decimal."""
    if count is None:
        return "—"
    if count < 1024:
        return f"{count} B"
    value = float(count)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def names(values: list[str] | None) -> str:
    return "" if values is None else ", ".join(values)


def usd_input(micros: int | None) -> str:
    """A budget for a form field: dollars, no trailing zeros."""
    if micros is None:
        return ""
    return format((Decimal(micros) / 1_000_000).normalize(), "f")


@cache
def templates() -> Jinja2Templates:
    built = Jinja2Templates(directory=str(TEMPLATE_DIR))
    built.env.globals["static_url"] = static_url
    built.env.filters.update(money=money, percent=percent, when=when, names=names,
                             usd_input=usd_input, size=size)
    return built


def is_htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


def page(request: Request, template: str, context: dict[str, Any], *,
         fragment: str | None = None, status_code: int = 200) -> HTMLResponse:
    """The whole page, or only `fragment` when htmx asked for it."""
    name = fragment if fragment is not None and is_htmx(request) else template
    response = templates().TemplateResponse(request, name, context, status_code=status_code)
    response.headers.update(PAGE_HEADERS)
    return response
