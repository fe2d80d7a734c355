"""Behaviour while the limiter's backend is down: short cool-down and rate-limited warnings."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("tenancy.limits")


class OutageGuard:
    """Remembers a failure for ``cooldown_s`` so a dead Redis costs one timeout per interval,
    not one per request, and warns at most once per ``warn_every_s``."""

    def __init__(
        self,
        *,
        cooldown_s: float = 1.0,
        warn_every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cooldown_s = cooldown_s
        self._warn_every_s = warn_every_s
        self._clock = clock
        self._down_until = float("-inf")
        self._next_warning = float("-inf")
        self._unreported = 0

    def is_down(self) -> bool:
        return self._clock() < self._down_until

    def failed(self, action: str, error: BaseException) -> None:
        """Record a failure; the warning names the error type only (messages may carry hosts)."""
        now = self._clock()
        self._down_until = now + self._cooldown_s
        self._unreported += 1
        if now < self._next_warning:
            return
        self._next_warning = now + self._warn_every_s
        log.warning(
            "rate-limit backend unavailable (%s during %s); %d failure(s) since last warning",
            type(error).__name__,
            action,
            self._unreported,
        )
        self._unreported = 0

    def recovered(self) -> None:
        self._down_until = float("-inf")
