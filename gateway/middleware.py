"""Pure ASGI middleware (streams pass through unbuffered).

Every response gets an `x-request-id` (the gateway's own) and an `x-gateway-overhead-ms`:
time spent in the gateway before the response started, minus the time spent waiting on the
upstream. Each request runs inside its log context (request id, later the tenant) and, when
tracing is on, a SERVER span that continues the caller's `traceparent`; it ends with one
`switchboard.access` log line (/health and /metrics are neither traced nor logged).

Bodies are limited on every route: announced as too large, they are refused with 413 before
they are read; otherwise the bytes actually received are counted as they stream in
(`gateway.body_guard`), before any parser sees them, and the whole body must arrive within a
timeout from the head (408). Adapter and file uploads have their own, larger limits and
timeouts; the console's sign-in form its own small one (`max_login_body_bytes`), since it is
answered before anyone is signed in. A client that leaves mid-body is logged at debug level
as a 499, never as a 500.
An answer given before the body has all been read closes the connection: otherwise a client
could hold it forever by dribbling a body nobody reads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from opentelemetry.trace import Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.body_guard import (
    CLOSE_CONNECTION,
    BodyGuard,
    BodyRefused,
    BodyTimedOut,
    too_large_response,
)
from gateway.errors import APIError
from gateway.observability.logs import current_request, request_log
from gateway.observability.tracing import REQUEST_ID
from workers.telemetry import is_traced, serve_traced

logger = logging.getLogger(__name__)
access_log = logging.getLogger("switchboard.access")

UPLOAD_SUFFIX = "/adapters/upload"  # admin and tenant adapter uploads
FILES_PATH = "/v1/files"  # POST: a tenant's file upload (the Batch API)
MULTIPART_SLACK = 64 << 10  # a file upload's form fields and boundaries, beside the file


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, body_timeout_s: float,
                 max_upload_bytes: int | None = None,
                 upload_timeout_s: float | None = None, max_file_bytes: int | None = None,
                 file_timeout_s: float | None = None, login_path: str = "",
                 max_login_bytes: int | None = None) -> None:
        self.app = app
        self.login_path = login_path  # POST: the console's sign-in form, before any session
        self.max_login_bytes = min(max_login_bytes or max_body_bytes, max_body_bytes)
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes or max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.upload_timeout_s = upload_timeout_s or body_timeout_s
        self.max_file_bytes = max_file_bytes or max_body_bytes
        self.file_timeout_s = file_timeout_s or body_timeout_s

    def limits(self, path: str, method: str) -> tuple[int, float]:
        """(most body bytes, seconds for the whole body) on this route."""
        if path.endswith(UPLOAD_SUFFIX):
            return self.max_upload_bytes, self.upload_timeout_s
        if path == FILES_PATH and method == "POST":
            return self.max_file_bytes + MULTIPART_SLACK, self.file_timeout_s
        if path == self.login_path and method == "POST":
            return self.max_login_bytes, self.body_timeout_s
        return self.max_body_bytes, self.body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        length = b""
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
        has_body = chunked or length.strip(b"0") != b""
        # Always our own: it is the usage record's unique key, which a caller must not pick.
        request_id = os.urandom(16).hex().encode()  # a uuid4 object costs 5x
        state = scope.setdefault("state", {})
        state["request_id"] = request_id.decode()
        state["upstream_s"] = 0.0
        status = 0
        path: str = scope.get("path", "")
        limit, timeout_s = self.limits(path, scope.get("method", ""))
        body = BodyGuard(receive, limit, timeout_s)
        finished = False  # the response's last byte was sent

        async def send_with_headers(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = 499 if body.disconnected else message["status"]
                body.response_started = True
                overhead_ms = (time.perf_counter() - started - state["upstream_s"]) * 1000
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id))
                headers.append((b"x-gateway-overhead-ms", b"%.3f" % max(0.0, overhead_ms)))
                if has_body and not body.complete and all(n != b"connection" for n, _ in headers):
                    headers.append((b"connection", b"close"))  # the rest of the body is unread
                message = {**message, "headers": headers}
            elif body.cut:  # the body came too late: the rest is dropped, the connection closed
                return
            elif message["type"] == "http.response.body":
                finished = not message.get("more_body", False)
            await send(message)

        traced = is_traced(path)

        async def serve(scope: Scope, receive: Receive, send: Send) -> None:
            nonlocal status
            error: BaseException | None = None
            try:
                if length and (not length.isdigit() or int(length) > limit):
                    await too_large_response(limit)(scope, receive, send)
                    return
                await self.app(scope, receive, send)
            except BodyRefused as exc:  # the app's handler answers it; this is a safety net
                if status:
                    raise
                await exc.response(scope.get("path", ""))(scope, receive, send)
            except Exception as exc:
                if body.timed_out:  # whatever broke, it broke on the late body (logged below)
                    if not status:
                        await BodyTimedOut(body.timeout_s).response(scope.get("path", ""))(
                            scope, receive, send)
                elif body.disconnected:  # whatever broke, it broke because the client left
                    status = 499
                    logger.debug("client disconnected mid-body on %s %s (%s)",
                                 scope.get("method"), path, type(exc).__name__)
                    return
                else:
                    error = exc  # the app answers 500; its ids are here only
                    logger.exception("unhandled error on %s %s", scope.get("method"), path)
                    raise
            except BaseException as exc:  # cancelled: the client left (499)
                error = exc
                raise
            finally:  # inside the request span, so the line carries its trace id
                if body.timed_out:
                    _body_timed_out(scope, body)
                if traced:
                    _log_request(scope, status, time.perf_counter() - started, error)
            if body.cut:
                close = scope.get("extensions", {}).get(CLOSE_CONNECTION)
                if close is not None:
                    close()
                elif not finished:  # a server without the extension closes on an exception
                    raise ConnectionAbortedError("request body timed out mid-response")

        tracer = _tracer(scope) if traced else None
        with request_log(state["request_id"]):
            if tracer is None:
                await serve(scope, body, send_with_headers)
            else:
                await serve_traced(tracer, scope, body, send_with_headers, serve,
                                   attributes={REQUEST_ID: state["request_id"]})


def _body_timed_out(scope: Scope, body: BodyGuard) -> None:
    """The one line for a late body: a 408, or a response cut short by closing."""
    logger.info("request body not received within %gs on %s %s (%d bytes arrived): %s",
                body.timeout_s, scope.get("method"), scope.get("path"), body.received,
                "response cut, connection closed" if body.cut else "408, connection closed")


def _tracer(scope: Scope) -> Tracer | None:
    """The app's tracer (None when tracing is off, or before startup)."""
    gateway = getattr(scope["app"].state, "gateway", None)
    return None if gateway is None else gateway.tracing.tracer


def _log_request(scope: Scope, status: int, elapsed_s: float, error: BaseException | None
                 ) -> None:
    """One line per request (probes and scrapes aside), with what the request path noted:
    model, deployment, outcome, tokens. The request and tenant ids come from the context.
    An exception that escaped before any answer is a 500 (the app's handler answers it); a
    client that left first is a 499."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    log = current_request()
    fields = {} if log is None else log.fields
    if error is not None and not status:
        status = 499 if isinstance(error, asyncio.CancelledError) else 500
        fields = {**fields, "error": type(error).__name__}
    method, path = scope.get("method", ""), scope.get("path", "")
    access_log.info("%s %s %d", method, path, status, extra={
        "method": method, "path": path, "status": status,
        "duration_ms": round(elapsed_s * 1000, 3), **fields})


class TenantUploadGuard:
    """Checks the tenant key on adapter uploads before the body (up to the upload limit, on
    disk) is read: an unauthenticated caller gets its 401 without costing a spooled file."""

    def __init__(self, app: ASGIApp, *, path: str) -> None:
        self.app = app
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == self.path:
            try:
                await scope["app"].state.gateway.keys.tenant(_authorization(scope))
            except APIError as exc:
                await exc.response(scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


class AdminGuard:
    """Checks the admin key on /admin paths before the route reads or parses any body.

    An unauthenticated caller gets 401/403, not a 400 about a body it had no right to send.
    The admin's context is left in the request state for the routes (`AdminDep`).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "http" and (path == "/admin" or path.startswith("/admin/")):
            try:
                admin = await scope["app"].state.gateway.keys.admin(_authorization(scope))
            except APIError as exc:
                await exc.response(scope.get("path", ""))(scope, receive, send)
                return
            scope.setdefault("state", {})["admin"] = admin
        await self.app(scope, receive, send)
