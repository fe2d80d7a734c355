"""The console's route class: turns "not signed in" into the sign-in page and a missing
CSRF token into a 403 page, instead of the API's JSON errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from starlette.responses import RedirectResponse, Response

from gateway.console.auth import LOGIN_PATH, PREFIX, CsrfRejected, LoginRequired
from gateway.console.render import is_htmx, page


class ConsoleRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def console_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except LoginRequired:
                return to_login(request)
            except CsrfRejected:
                return page(request, "error.html", {
                    "title": "Forbidden",
                    "message": "This change was refused: its CSRF token is missing or wrong. "
                               "Reload the page and try again."},
                    fragment="_error.html", status_code=403)

        return console_handler


def console_router(**kwargs: Any) -> APIRouter:
    return APIRouter(route_class=ConsoleRoute, include_in_schema=False, **kwargs)


def safe_next(target: str | None) -> str:
    """Where to go after signing in: only a console path, never another site."""
    if target and target.startswith(f"{PREFIX}/") and not target.startswith("//") \
            and "\\" not in target and target != LOGIN_PATH:
        return target
    return f"{PREFIX}/tenants"


def to_login(request: Request) -> Response:
    if is_htmx(request):  # a fragment request: make htmx load the sign-in page itself
        return Response(status_code=200, headers={"hx-redirect": LOGIN_PATH})
    target = request.url.path
    if request.method != "GET":
        return RedirectResponse(LOGIN_PATH, status_code=303)
    if request.url.query:
        target += f"?{request.url.query}"
    return RedirectResponse(f"{LOGIN_PATH}?next={quote(target, safe='')}", status_code=303)
