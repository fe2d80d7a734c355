"""Throttled warnings: every failure counted, one log line per interval."""

from __future__ import annotations

import logging

import pytest

from caching.throttle import ThrottledWarning


def test_logs_once_per_interval_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    warn = ThrottledWarning(logging.getLogger("test.throttle"), interval_s=10,
                            clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        for _ in range(5):
            warn("cache down", ConnectionError("refused"))
        now[0] = 10.0
        warn("cache down", ConnectionError("refused"))
    assert warn.count == 6
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["cache down: ConnectionError: refused",
                        "cache down: ConnectionError: refused (4 more since the last warning)"]
