"""uvicorn's httptools protocol with the connection limits uvicorn lacks.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`), but it has no limit on the
size of a request head, no timeout for receiving one, and no cap on open connections: a
client could hold a connection open forever with half a header, or grow one header without
end. This subclass adds, per connection:

- a header-read timeout: from the connection's start, and from the first byte of each further
  request, the whole head (request line and headers) must arrive within the timeout, else
  the connection gets 408 and is closed;
- a head size limit: a head larger than the limit gets 431 and the connection is closed; an
  unfinished head is counted as it arrives, so at most one read past the limit is buffered
  (what httptools keeps of a header it has not finished parsing);
- a connection cap: a connection past it gets 503 at once and is closed, before any of its
  bytes are read.

It also offers each request the `CLOSE_CONNECTION` ASGI extension (`gateway.body_guard`): the
middleware cuts a response whose request body came too late, which plain ASGI can only do by
raising (logged by uvicorn as an application error).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.body_guard import CLOSE_CONNECTION

logger = logging.getLogger(__name__)

REFUSALS = {
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_header_bytes: int
    header_read_timeout_s: float
    max_connections: int


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """Set `limits` on a subclass (`guarded_protocol`): uvicorn builds protocols itself.

    Cheap on the hot path: a request costs a clock read and a few attribute writes. The head's
    exact size is computed only when its reads add up to more than the limit, and the timer is
    not re-armed per request: one pending timer per connection checks the current deadline
    when it fires."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_deadline: float | None = None  # while a head is awaited or being read
        self._in_head = True  # waiting for, or reading, a request head
        self._raw_head_bytes = 0  # earlier reads of the unfinished head
        self._read_bytes = 0  # the read being parsed
        self._boundaries = 0  # heads and messages completed, to tell where a read ended
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            logger.warning("connection refused: %d open, the cap is %d",
                           len(self.connections) - 1, self.limits.max_connections)
            self._refuse(503)
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._read_bytes = len(data)
        before = self._boundaries
        super().data_received(data)
        if self._refused or not self._in_head:
            return
        if self._boundaries == before:  # this whole read belongs to the unfinished head
            self._raw_head_bytes += len(data)
            if self._raw_head_bytes > self.limits.max_header_bytes:
                self._refuse(431)
        else:  # a message ended within it: count the next head from the next read on
            self._raw_head_bytes = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._head_deadline is None:  # the first head keeps the connection's deadline
            self._await_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._boundaries += 1
        self._head_deadline = None
        if (self._raw_head_bytes + self._read_bytes > self.limits.max_header_bytes
                and self._head_size() > self.limits.max_header_bytes):
            self._refuse(431)
            return
        self._raw_head_bytes = 0
        super().on_headers_complete()
        self.scope["extensions"] = {CLOSE_CONNECTION: self._close_connection}

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._boundaries += 1
        self._in_head = True
        self._raw_head_bytes = 0
        if not self._refused:
            super().on_message_complete()

    def _close_connection(self) -> None:
        """Close the connection, its latest request ending as a client disconnect does (its
        app reads `http.disconnect`, its sends are dropped, nothing is logged). Only that
        request can ask: one whose body is unfinished has no request pipelined after it."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if not self.transport.is_closing():
            self.transport.close()

    def _head_size(self) -> int:
        """The parsed head: request line and header lines, as sent."""
        return len(self.url) + 16 + sum(len(n) + len(v) + 4 for n, v in self.headers)

    def _await_head(self) -> None:
        timeout = self.limits.header_read_timeout_s
        self._head_deadline = self.loop.time() + timeout
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(timeout, self._check_head)

    def _check_head(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._head_deadline is None:
            return  # no head awaited now; the next one arms the timer again
        left = self._head_deadline - self.loop.time()
        if left > 0:
            self._head_timer = self.loop.call_later(left, self._check_head)
        elif self.cycle is not None and not self.cycle.response_complete:
            # a pipelined head waits for the answer before it: not cut, checked again later
            self._head_deadline = self.loop.time() + self.limits.header_read_timeout_s
            self._head_timer = self.loop.call_later(self.limits.header_read_timeout_s,
                                                    self._check_head)
        else:
            self._refuse(408)

    def _refuse(self, status: int) -> None:
        """Answer `status` and close; nothing more is read or run on this connection."""
        self._refused = True
        self._head_deadline = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self.transport.is_closing():
            return
        reason = REFUSALS[status]
        body = b"%d %s" % (status, reason)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, reason, len(body), body))
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn's `http=`, carrying these limits."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})
