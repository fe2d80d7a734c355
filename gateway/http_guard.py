"""uvicorn's httptools protocol with the connection limits uvicorn lacks.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`), but it has no limit on the
size of a request head, no timeout for receiving one, and no cap on open connections: a
client could hold a connection open forever with half a header, or grow one header without
end. This subclass adds, per connection:

- a header-read timeout: from the connection's start, and from the first byte of each further
  request, the whole head (request line and headers) must arrive within the timeout, else
  the connection gets 408 and is closed;
- a head size limit: a head larger than the limit gets 431 and the connection is closed; an
  unfinished head is counted as it arrives, so at most one read past the limit is buffered;
- a connection cap: a connection past it gets 503 at once and is closed, before any of its
  bytes are read.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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
    """Set `limits` on a subclass (`guarded_protocol`): uvicorn builds protocols itself."""

    limits: ConnectionLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # waiting for, or reading, a request head
        self._head_bytes = 0  # of the head being read, as parsed
        self._raw_head_bytes = 0  # of the head being read, as received while it is unfinished
        self._boundaries = 0  # heads and messages completed, to tell where a read ended
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        if len(self.connections) > self.limits.max_connections:
            logger.warning("connection refused: %d open, the cap is %d",
                           len(self.connections) - 1, self.limits.max_connections)
            self._refuse(503)
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        before = self._boundaries
        super().data_received(data)
        if self._refused or not self._in_head:
            return
        if self._boundaries == before:  # this whole read belongs to the unfinished head
            self._raw_head_bytes += len(data)
        else:  # a message ended within it: count the new head from the next read on
            self._raw_head_bytes = 0
        if self._raw_head_bytes > self.limits.max_header_bytes:
            self._refuse(431)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_bytes += len(name) + len(value) + 4  # ": " and CRLF

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._boundaries += 1
        self._disarm_head_timer()
        if self._head_bytes > self.limits.max_header_bytes:
            self._refuse(431)
            return
        self._head_bytes = self._raw_head_bytes = 0
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._boundaries += 1
        self._in_head = True
        self._head_bytes = self._raw_head_bytes = 0
        if not self._refused:
            super().on_message_complete()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_read_timeout_s,
                                                self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined head waits for the answer before it; not cut
            return
        self._refuse(408)

    def _refuse(self, status: int) -> None:
        """Answer `status` and close; nothing more is read or run on this connection."""
        self._refused = True
        self._disarm_head_timer()
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
