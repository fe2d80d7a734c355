"""The body limits on the bytes actually received, and a client that leaves mid-body.

`Content-Length` can be absent (chunked) or lie, so the size limit is counted on what
`receive` hands the app, before any form or JSON parser sees it; nothing is buffered here.
Past the limit `receive` raises `BodyTooLarge`. A client can also send its head and then
dribble its body, or stop: the whole body must arrive within a timeout from the head, or
`receive` raises `BodyTimedOut`. Both are HTTPExceptions, because FastAPI's body parsing
re-raises those as they are, so the app's handler answers 413 or 408 in OpenAI's shape; both
close the connection, so the rest of the body is never read.

Once the response has started a 408 can no longer be sent: the response is cut instead. The
late body reads as the client leaving (`http.disconnect`), the middleware drops what the app
still sends and closes the connection.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import Message, Receive

from gateway.errors import APIError, body_timeout, too_large

DISCONNECT: Message = {"type": "http.disconnect"}
# An ASGI extension a server may offer (`gateway.http_guard` does): a callable that closes the
# request's connection at once, the response cut short, with nothing logged as an error.
CLOSE_CONNECTION = "switchboard.close_connection"


class BodyRefused(HTTPException):
    """A body refused while it was being received; `code` is its OpenAI error code."""

    def __init__(self, error: APIError) -> None:
        error.headers["connection"] = "close"
        super().__init__(error.status, error.message, headers=error.headers)
        self.code = error.code
        self._error = error

    def response(self, path: str = "") -> Response:
        return self._error.response(path)


class BodyTooLarge(BodyRefused):
    """A body that grew past its limit while it was being received."""

    def __init__(self, limit: int) -> None:
        super().__init__(too_large(limit))


class BodyTimedOut(BodyRefused):
    """A body that had not all arrived when its time was up."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(body_timeout(timeout_s))


def too_large_response(limit: int) -> Response:
    """The 413 for a body announced as too large; closing, so its bytes are never read."""
    return BodyTooLarge(limit).response()


class BodyGuard:
    """One request's `receive`, counting body bytes against `limit` and waiting for them
    until `timeout_s` after it is made (the app is called once the head has arrived).

    `disconnected` is set when the client went away before its body was complete: whatever
    the app then raises or answers is the client's leaving, not a server error. `timed_out`
    is set when the body was late, and `cut` too when the response had started by then (the
    middleware sets `response_started`)."""

    def __init__(self, receive: Receive, limit: int, timeout_s: float) -> None:
        self._receive = receive
        self.limit = limit
        self.timeout_s = timeout_s
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self.received = 0
        self.complete = False
        self.disconnected = False
        self.timed_out = False
        self.cut = False
        self.response_started = False

    async def __call__(self) -> Message:
        if self.timed_out:
            return DISCONNECT
        if self.complete:  # only a disconnect is left to wait for: no deadline
            message = await self._receive()
        else:
            try:
                async with asyncio.timeout_at(self._deadline):
                    message = await self._receive()
            except TimeoutError:
                self.timed_out = True
                if self.response_started:
                    self.cut = True
                    return DISCONNECT
                raise BodyTimedOut(self.timeout_s) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.complete = not message.get("more_body", False)
            if self.received > self.limit:
                raise BodyTooLarge(self.limit)
        elif message["type"] == "http.disconnect" and not self.complete:
            self.disconnected = True
        return message
