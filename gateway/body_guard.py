"""The body limit on the bytes actually received, and a client that leaves mid-body.

`Content-Length` can be absent (chunked) or lie, so the limit is counted on what `receive`
hands the app, before any form or JSON parser sees it; nothing is buffered here. Past the
limit `receive` raises `BodyTooLarge`: an HTTPException, because FastAPI's body parsing
re-raises those as they are, so the app's handler answers 413 in OpenAI's shape. The 413
closes the connection, so the rest of the body is never read.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Message, Receive

from gateway.errors import too_large


class BodyTooLarge(HTTPException):
    """A body that grew past its limit while it was being received."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large(limit).message, headers={"connection": "close"})


def too_large_response(limit: int) -> Response:
    """The 413 for a body announced as too large; closing, so its bytes are never read."""
    error = too_large(limit)
    error.headers["connection"] = "close"
    return error.response()


class BodyGuard:
    """One request's `receive`, counting body bytes against `limit`.

    `disconnected` is set when the client went away before its body was complete: whatever
    the app then raises or answers is the client's leaving, not a server error."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self._receive = receive
        self.limit = limit
        self.received = 0
        self.complete = False
        self.disconnected = False

    async def __call__(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.complete = not message.get("more_body", False)
            if self.received > self.limit:
                raise BodyTooLarge(self.limit)
        elif message["type"] == "http.disconnect" and not self.complete:
            self.disconnected = True
        return message
