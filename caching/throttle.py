"""A warning that is logged at most once per interval, with a count of the ones it held back.

A cache backend that goes down fails every request; logging each failure would flood the logs
exactly when someone needs to read them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class ThrottledWarning:
    """Counts every failure, logs the first one and then at most one per `interval_s`."""

    def __init__(self, logger: logging.Logger, *, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._held = 0
        self.count = 0

    def __call__(self, message: str, error: BaseException) -> None:
        self.count += 1
        now = self._clock()
        if self._last is not None and now - self._last < self._interval_s:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        suffix = f" ({held} more since the last warning)" if held else ""
        self._logger.warning("%s: %s: %s%s", message, type(error).__name__, error, suffix)
