"""The circuit breaker's transitions, on a fake clock."""

from __future__ import annotations

from gateway.routing.breaker import BreakerSettings, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, threshold: int = 3, window: float = 10.0,
            cooldown: float = 5.0) -> CircuitBreaker:
    return CircuitBreaker(BreakerSettings(threshold, window, cooldown), clock=clock)


def test_opens_after_threshold_failures_within_the_window() -> None:
    clock = Clock()
    b = breaker(clock)
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.try_acquire()
    b.record_failure()
    assert b.state == "open"
    assert not b.available() and not b.try_acquire()
    snap = b.snapshot()
    assert snap.times_opened == 1 and snap.retry_in_s == 5.0


def test_old_failures_leave_the_window() -> None:
    clock = Clock()
    b = breaker(clock)
    b.record_failure()
    b.record_failure()
    clock.now += 10.5
    b.record_failure()
    assert b.state == "closed"
    assert b.snapshot().recent_failures == 1


def test_success_does_not_reset_closed_window_but_half_open_probe_closes() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now += 4.9
    assert b.state == "open" and not b.try_acquire()
    clock.now += 0.1
    assert b.state == "half_open" and b.available()
    assert b.try_acquire()  # the one probe
    assert not b.available() and not b.try_acquire()  # nobody else meanwhile
    b.record_success()
    assert b.state == "closed" and b.try_acquire()
    assert b.snapshot().recent_failures == 0


def test_failed_probe_reopens_for_another_cooldown() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now += 5
    assert b.try_acquire()
    b.record_failure()
    assert b.state == "open"
    assert b.snapshot().times_opened == 2
    clock.now += 4
    assert not b.try_acquire()
    clock.now += 1
    assert b.try_acquire()


def test_released_probe_lets_the_next_one_through() -> None:
    clock = Clock()
    b = breaker(clock, threshold=1)
    b.record_failure()
    clock.now += 5
    assert b.try_acquire()
    b.release()  # the client left before a verdict
    assert b.state == "half_open" and b.try_acquire()


def test_reset_closes() -> None:
    clock = Clock()
    b = breaker(clock, threshold=1)
    b.record_failure()
    assert b.state == "open"
    b.reset()
    assert b.state == "closed" and b.try_acquire()
