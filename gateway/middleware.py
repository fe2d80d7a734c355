"""Pure ASGI middleware (streams pass through unbuffered).

Every response gets an `x-request-id` (the caller's, if it sent a sane one) and an
`x-gateway-overhead-ms`: time spent in the gateway before the response started, minus the
time spent waiting on the upstream. Bodies announced as too large are refused with 413 before
they are read. Adapter uploads have their own, larger limit, also enforced while the body
streams in (multipart bodies are spooled to disk as they arrive).
"""

from __future__ import annotations

import time
import uuid

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, too_large

UPLOAD_SUFFIX = "/adapters/upload"  # admin and tenant adapter uploads


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int,
                 max_upload_bytes: int | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes or max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        length = b""
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
        # Always our own: it is the usage record's unique key, which a caller must not pick.
        request_id = uuid.uuid4().hex.encode()
        state = scope.setdefault("state", {})
        state["request_id"] = request_id.decode()
        state["upstream_s"] = 0.0

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                overhead_ms = (time.perf_counter() - started - state["upstream_s"]) * 1000
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id))
                headers.append((b"x-gateway-overhead-ms", b"%.3f" % max(0.0, overhead_ms)))
                message = {**message, "headers": headers}
            await send(message)

        limit = self.max_body_bytes
        if scope.get("path", "").endswith(UPLOAD_SUFFIX):
            limit = self.max_upload_bytes
            receive = _limited(receive, limit)
        if length and (not length.isdigit() or int(length) > limit):
            await too_large(limit).response()(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that refuses (413) a body growing past `limit`, however it is framed."""
    size = 0

    async def receive_limited() -> Message:
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:  # FastAPI re-raises HTTPException from body parsing as it is
                raise HTTPException(413, too_large(limit).message)
        return message

    return receive_limited


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
                await exc.response()(scope, receive, send)
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
                await exc.response()(scope, receive, send)
                return
            scope.setdefault("state", {})["admin"] = admin
        await self.app(scope, receive, send)
