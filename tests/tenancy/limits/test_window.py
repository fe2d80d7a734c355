"""The 60 s sliding window, driven by a fake clock on the in-process backend."""

from __future__ import annotations

import random

from tenancy.limits import AdmissionRequest, InProcessLimiter, Limits
from tenancy.limits.window import BucketWindow
from tests.tenancy.limits.conftest import FakeClock

T0 = 1_000_000.0


def request(n: int, limits: Limits, tokens: int = 1) -> AdmissionRequest:
    return AdmissionRequest(f"r{n}", (("key:a", limits),), tokens=tokens)


async def test_requests_age_out_after_the_window() -> None:
    clock = FakeClock(T0 + 0.5)
    limiter = InProcessLimiter(clock=clock)
    limits = Limits(rpm=2)
    assert (await limiter.admit(request(1, limits))).admitted
    clock.now = T0 + 30.2
    assert (await limiter.admit(request(2, limits))).admitted

    clock.now = T0 + 59.0
    refused = await limiter.admit(request(3, limits))
    assert refused.reason == "rpm"
    assert refused.retry_after_s == 2.0  # the first bucket (second T0) counts until T0 + 61
    clock.advance(refused.retry_after_s - 0.01)
    assert (await limiter.admit(request(3, limits))).reason == "rpm"
    clock.advance(0.01)
    assert (await limiter.admit(request(3, limits))).admitted
    assert (await limiter.admit(request(4, limits))).reason == "rpm"


async def test_tpm_retry_after_waits_for_enough_tokens() -> None:
    clock = FakeClock(T0)
    limiter = InProcessLimiter(clock=clock)
    limits = Limits(tpm=100)
    for n, tokens in enumerate([30, 30, 30]):
        assert (await limiter.admit(request(n, limits, tokens))).admitted
        clock.advance(10)
    refused = await limiter.admit(request(9, limits, 50))  # needs two entries to age out
    assert refused.reason == "tpm"
    assert refused.retry_after_s == T0 + 10 + 61 - clock.now
    clock.advance(refused.retry_after_s)
    assert (await limiter.admit(request(9, limits, 50))).admitted


async def test_no_60s_span_ever_exceeds_the_limit() -> None:
    """Random traffic for 5 simulated minutes; check every window of 60 s afterwards."""
    rng = random.Random(7)
    clock = FakeClock(T0)
    limiter = InProcessLimiter(clock=clock)
    limits = Limits(rpm=20, tpm=2000)
    admitted: list[tuple[float, int]] = []
    for n in range(3000):
        clock.advance(rng.expovariate(10.0))
        tokens = rng.randint(1, 200)
        if (await limiter.admit(request(n, limits, tokens))).admitted:
            admitted.append((clock.now, tokens))
    assert len(admitted) > 80  # the limit was reached many times over
    for start, _ in admitted:
        span = [tokens for t, tokens in admitted if start <= t < start + 60]
        assert len(span) <= 20
        assert sum(span) <= 2000


async def test_idle_scopes_are_forgotten() -> None:
    clock = FakeClock(T0)
    limiter = InProcessLimiter(clock=clock)
    for n in range(50):
        await limiter.admit(AdmissionRequest(f"r{n}", ((f"key:{n}", Limits(rpm=1)),), tokens=1))
        await limiter.settle(
            AdmissionRequest(f"r{n}", ((f"key:{n}", Limits(rpm=1)),), tokens=1),
            tokens=1,
            cost_micros=0,
        )
    clock.advance(3600)
    await limiter.admit(request(999, Limits(rpm=1)))
    assert set(limiter._scopes) == {"key:a"}


def test_bucket_window_adjusts_only_live_buckets() -> None:
    window = BucketWindow()
    window.add(100, 50)
    window.adjust(100, -20, now=150.0)
    assert window.total() == 30
    window.adjust(100, -999, now=150.0)
    assert window.is_empty()
    window.add(100, 50)
    window.adjust(100, -20, now=161.0)  # aged out: left alone, pruned next
    window.prune(161.0)
    assert window.is_empty()
