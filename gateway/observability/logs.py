"""Structured logs: one JSON object per line, stamped with the request, tenant and trace.

Every record gets `request_id` and `tenant_id` (from the request being served, see
`request_log`) and `trace_id`/`span_id` (from the current span, when tracing is on). Anything
that looks like a credential is redacted from messages, extra fields and tracebacks before it
is written: tenant and admin keys keep only their public id, other `sk-...` keys, bearer
tokens, passwords in URLs and `api_key=`-style pairs are masked, and so are extra fields named
like secrets. Prompt and completion text is logged only where `log_prompts` asks for it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from tenancy.keys import ADMIN_PREFIX, KEY_PREFIX

if TYPE_CHECKING:
    from gateway.settings import Settings

REDACTED = "[REDACTED]"
CONTEXT_FIELDS = ("request_id", "tenant_id", "trace_id", "span_id")

# Tenant/admin keys: the id after the prefix is public (usage records carry it), the secret
# is not. Then any other `sk-` key, bearer/basic credentials, a URL's password, and
# `api_key=...`-style pairs (also quoted JSON).
_SB_KEY = re.compile(
    rf"({re.escape(ADMIN_PREFIX)}|{re.escape(KEY_PREFIX)})([a-z0-9]{{12}})-[0-9A-Za-z]+")
_OTHER_KEY = re.compile(r"\bsk-(?!sb-[a-z0-9-]*\[REDACTED\])[A-Za-z0-9][A-Za-z0-9_\-]{5,}")
_AUTH_SCHEME = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=\-]+")
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://[^/\s:@]*):[^/\s@]+@")
_SECRET_PAIR = re.compile(
    r"(?i)\b((?:api[_-]?key|apikey|password|passwd|secret(?:_key)?|access[_-]?token|"
    r"token|authorization)[\"']?\s*[:=]\s*[\"']?)(?!Bearer\b|Basic\b|\[REDACTED\])"
    r"[^\s\"'&,;}]+")
# Text without any of these cannot hold a credential the patterns above would mask.
_MAYBE = re.compile(r"(?i)sk-|://|bearer|basic|[:=]")
# Extra fields whose value is a secret whatever it looks like.
_SECRET_NAME = re.compile(
    r"(?i)^(authorization|proxy[_-]authorization|cookie|set[_-]cookie|x[_-]api[_-]key|"
    r"api[_-]?key|.*password|passwd|.*secret(_key)?|token|.*_token|pepper)$")

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName", *CONTEXT_FIELDS}


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with credentials masked (see the module doc), and any of `secrets` verbatim."""
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    if not _MAYBE.search(text):
        return text
    if "sk-" in text:
        text = _SB_KEY.sub(rf"\1\2-{REDACTED}", text)
        text = _OTHER_KEY.sub(f"sk-{REDACTED}", text)
    text = _AUTH_SCHEME.sub(rf"\1\2{REDACTED}", text)
    if "://" in text:
        text = _URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)
    return _SECRET_PAIR.sub(rf"\1{REDACTED}", text)


@functools.lru_cache(maxsize=1024)
def _secret_name(name: str) -> bool:
    return _SECRET_NAME.match(name) is not None


def redact_value(name: str, value: Any, secrets: Iterable[str] = ()) -> Any:
    """An extra field's value, masked whole when its name says it is a secret."""
    if _secret_name(name):
        return REDACTED
    kind = type(value)
    if kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is str:
        return redact(value, secrets)
    if isinstance(value, dict):
        return {k: redact_value(str(k), v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(name, v, secrets) for v in value]
    return value if isinstance(value, int | float) else redact(str(value), secrets)


# ----------------------------------------------------------------------- the request's context


@dataclass
class RequestLog:
    """What this request's log lines say about it; mutable, so what the handler learns (the
    tenant) is seen by the middleware's and the stream's lines too, whatever task they run in."""

    request_id: str
    tenant_id: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)


_current: ContextVar[RequestLog | None] = ContextVar("switchboard_request_log", default=None)


@contextmanager
def request_log(request_id: str) -> Iterator[RequestLog]:
    """Log lines inside the block (and in tasks started from it) name this request."""
    log = RequestLog(request_id)
    token = _current.set(log)
    try:
        yield log
    finally:
        _current.reset(token)


def bind_tenant(tenant_id: str) -> None:
    """The authenticated tenant, for the rest of this request's log lines."""
    log = _current.get()
    if log is not None:
        log.tenant_id = tenant_id


def note(**fields: Any) -> None:
    """Fields for this request's access line (model, deployment, outcome, token counts)."""
    log = _current.get()
    if log is not None:
        log.fields.update(fields)


def current_request() -> RequestLog | None:
    return _current.get()


# ---------------------------------------------------------------------------------- formatters


def context_fields() -> dict[str, str | None]:
    log = _current.get()
    span = trace.get_current_span().get_span_context()
    return {
        "request_id": None if log is None else log.request_id,
        "tenant_id": None if log is None else log.tenant_id,
        "trace_id": format(span.trace_id, "032x") if span.is_valid else None,
        "span_id": format(span.span_id, "016x") if span.is_valid else None,
    }


class ContextFilter(logging.Filter):
    """Stamps each record with the request, tenant and trace it was logged under (filters run
    where the record is made, so the context is the right one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in context_fields().items():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, the context fields, the record's
    `extra` fields, and `exception` (the traceback as one string); all redacted."""

    def __init__(self, *, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage(), self.secrets),
        }
        stamped = hasattr(record, "request_id")  # by ContextFilter, where it was logged
        context = ({name: getattr(record, name, None) for name in CONTEXT_FIELDS} if stamped
                   else context_fields())
        out.update((name, value) for name, value in context.items() if value is not None)
        for name, value in record.__dict__.items():
            if name not in _RECORD_ATTRS and not name.startswith("_"):
                out[name] = redact_value(name, value, self.secrets)
        if record.exc_info:
            out["exception"] = redact(self.formatException(record.exc_info), self.secrets)
        elif record.exc_text:
            out["exception"] = redact(record.exc_text, self.secrets)
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info), self.secrets)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Plain lines for a terminal (`ts LEVEL logger [request id] message`), redacted the same
    way; the request id only inside a request."""

    def __init__(self, *, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def format(self, record: logging.LogRecord) -> str:
        request_id = (getattr(record, "request_id", None) if hasattr(record, "request_id")
                      else context_fields()["request_id"])
        head = f"{self.formatTime(record)} {record.levelname} {record.name}"
        text = f"{head} [{request_id}] " if request_id else f"{head} "
        text += record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return redact(text, self.secrets)


def configured_secrets(settings: Settings) -> tuple[str, ...]:
    """The settings' own secrets, to mask verbatim wherever they would appear."""
    return tuple(s for s in (settings.secret_key, settings.worker_secret,
                             settings.metrics_token) if s)


def configure_logging(level: str, fmt: str, *, secrets: Iterable[str] = ()) -> None:
    """Route every logger through one stderr handler in `fmt` ("json" or "text").

    `secrets`: values (server secrets, tokens) to mask wherever they appear. Called once by the
    CLI, never at import."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter(secrets=secrets) if fmt == "json"
                         else TextFormatter(secrets=secrets))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)
