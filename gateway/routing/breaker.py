"""A circuit breaker per deployment, so a dead upstream costs one fast skip, not a timeout.

closed -> (N failures within the window) -> open -> (cooldown) -> half_open: one probe at a
time -> success closes, failure opens again for another cooldown.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

State = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 5
    window_s: float = 30.0
    cooldown_s: float = 15.0


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    state: State
    recent_failures: int
    opened_at: float | None
    retry_in_s: float | None  # while open: time until a probe is allowed
    times_opened: int


class CircuitBreaker:
    def __init__(self, settings: BreakerSettings | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or BreakerSettings()
        self._clock = clock
        self._failures: deque[float] = deque()
        self._state: State = "closed"
        self._opened_at: float | None = None
        self._probing = False
        self.times_opened = 0

    @property
    def state(self) -> State:
        """The state now (an open breaker whose cooldown is over reads as half_open)."""
        if self._state == "open" and self._cooldown_over():
            return "half_open"
        return self._state

    def available(self) -> bool:
        """Whether a request may be sent now, without claiming the half-open probe."""
        state = self.state
        return state == "closed" or (state == "half_open" and not self._probing)

    def try_acquire(self) -> bool:
        """Claim the right to send one request; in half_open only one probe is out at once."""
        state = self.state
        if state == "closed":
            return True
        if state == "open" or self._probing:
            return False
        self._state = "half_open"
        self._probing = True
        return True

    def record_success(self) -> None:
        if self._state != "closed":
            self._state = "closed"
            self._opened_at = None
            self._failures.clear()
        self._probing = False

    def record_failure(self) -> None:
        now = self._clock()
        if self._state == "half_open" or self.state == "half_open":
            self._open(now)  # the probe failed
            return
        if self._state == "open":
            return
        self._failures.append(now)
        self._forget_old(now)
        if len(self._failures) >= self.settings.failure_threshold:
            self._open(now)

    def release(self) -> None:
        """The claimed request ended without a verdict (the client left): free the probe."""
        self._probing = False

    def reset(self) -> None:
        self._state = "closed"
        self._opened_at = None
        self._failures.clear()
        self._probing = False

    def snapshot(self) -> BreakerSnapshot:
        now = self._clock()
        self._forget_old(now)
        retry_in = None
        if self._state == "open" and self._opened_at is not None:
            retry_in = max(0.0, self._opened_at + self.settings.cooldown_s - now)
        return BreakerSnapshot(self.state, len(self._failures), self._opened_at, retry_in,
                               self.times_opened)

    def _open(self, now: float) -> None:
        self._state = "open"
        self._opened_at = now
        self._probing = False
        self._failures.clear()
        self.times_opened += 1

    def _cooldown_over(self) -> bool:
        assert self._opened_at is not None
        return self._clock() - self._opened_at >= self.settings.cooldown_s

    def _forget_old(self, now: float) -> None:
        horizon = now - self.settings.window_s
        while self._failures and self._failures[0] < horizon:
            self._failures.popleft()
