"""Per-source backoff on repeated authentication failures (bearer keys, console sign-in).

Every 401 the gateway answers (a wrong API key, admin key, metrics token, or console sign-in)
is a failure of the client's address. The first `free` failures cost nothing; after them each
failure closes the source out for twice as long as the one before (1 s, 2 s, 4 s ... up to
`max_s`), during which its requests get 429 with `Retry-After` before any key is looked at.
A request that presented credentials and was answered below 400 clears the source. The table
is in memory, per process, and bounded: past `max_sources` the least recently failing source
is forgotten, and a source quiet for `FORGET_AFTER_S` starts again from zero.

The source is the ASGI client address; behind a proxy, uvicorn takes it from
`X-Forwarded-For` only for the proxies in `FORWARDED_ALLOW_IPS`. Loopback sources are never
throttled: they are this machine (its scripts and checks), or a local proxy that did not say
whose request it forwards, and throttling that would shut out every client behind it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.addresses import is_loopback
from gateway.errors import APIError

FORGET_AFTER_S = 900.0
UNTHROTTLED_PREFIXES = ("/health",)  # probes never carry credentials
LOGIN_PATH = "/console/login"


@dataclass(slots=True)
class _Source:
    failures: int = 0
    blocked_until: float = 0.0
    last_failure: float = 0.0


class FailureThrottle:
    """The backoff table; `clock` is injectable so tests need no sleeping."""

    def __init__(self, *, free: int, max_s: float, max_sources: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.free = free
        self.max_s = max_s
        self.max_sources = max_sources
        self._clock = clock
        self._sources: OrderedDict[str, _Source] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sources)

    def retry_after(self, source: str) -> float:
        """Seconds until `source` may try again; 0 when it may now."""
        entry = self._sources.get(source)
        if entry is None:
            return 0.0
        now = self._clock()
        if now - entry.last_failure > FORGET_AFTER_S:
            del self._sources[source]
            return 0.0
        return max(0.0, entry.blocked_until - now)

    def failed(self, source: str) -> None:
        now = self._clock()
        entry = self._sources.pop(source, None) or _Source()
        if now - entry.last_failure > FORGET_AFTER_S:
            entry = _Source()
        entry.failures += 1
        entry.last_failure = now
        over = entry.failures - self.free
        if over > 0:
            entry.blocked_until = now + min(self.max_s, 2.0 ** min(over - 1, 62))
        self._sources[source] = entry  # most recent last
        while len(self._sources) > self.max_sources:
            self._sources.popitem(last=False)

    def succeeded(self, source: str) -> None:
        self._sources.pop(source, None)


class AuthThrottle:
    """ASGI middleware applying a `FailureThrottle` to every route but the probes."""

    def __init__(self, app: ASGIApp, *, throttle: FailureThrottle) -> None:
        self.app = app
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or path.startswith(UNTHROTTLED_PREFIXES):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        source = client[0] if client else "unknown"
        if is_loopback(source):
            await self.app(scope, receive, send)
            return
        wait_s = self.throttle.retry_after(source)
        if wait_s > 0:
            await APIError(429, "Too many failed authentication attempts from your address; "
                           "retry later.", code="too_many_auth_failures",
                           headers={"retry-after": str(math.ceil(wait_s))}
                           ).response(path)(scope, receive, send)
            return
        credentials = (path == LOGIN_PATH and scope.get("method") == "POST") or any(
            name in (b"authorization", b"x-api-key") for name, _ in scope["headers"])

        async def send_observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 401:
                    self.throttle.failed(source)
                elif credentials and status < 400:
                    self.throttle.succeeded(source)
            await send(message)

        await self.app(scope, receive, send_observed)
