"""Settle releases the slot and reconciles the token reservation to the real count."""

from __future__ import annotations

import asyncio

from tenancy.limits import AdmissionRequest, Limiter, Limits
from tests.tenancy.limits.conftest import FakeClock

SCOPES = (("key:a", Limits(tpm=1000, max_concurrent=1)), ("tenant:t", Limits(tpm=5000)))


def request(request_id: str, tokens: int, scopes=SCOPES) -> AdmissionRequest:
    return AdmissionRequest(request_id=request_id, scopes=scopes, tokens=tokens)


async def test_settle_refunds_unused_tokens(limiter: Limiter) -> None:
    first = request("r1", 1000)
    assert (await limiter.admit(first)).admitted
    assert (await limiter.admit(request("r2", 1))).reason in ("tpm", "concurrency")
    await limiter.settle(first, tokens=100, cost_micros=0)

    second = await limiter.admit(request("r2", 900))
    assert second.admitted, second
    assert second.remaining_tokens == 0  # 100 real + 900 reserved at the key
    await limiter.settle(request("r2", 900), tokens=900, cost_micros=0)
    assert (await limiter.admit(request("r3", 1))).reason == "tpm"


async def test_settle_releases_the_concurrency_slot(limiter: Limiter) -> None:
    scopes = (("key:a", Limits(max_concurrent=1)),)
    first = request("r1", 1, scopes)
    assert (await limiter.admit(first)).admitted
    assert (await limiter.admit(request("r2", 1, scopes))).reason == "concurrency"
    await limiter.settle(first, tokens=1, cost_micros=0)
    assert (await limiter.admit(request("r2", 1, scopes))).admitted


async def test_settle_twice_refunds_once(limiter: Limiter) -> None:
    scopes = (("key:a", Limits(tpm=1000)),)
    first = request("r1", 600, scopes)
    assert (await limiter.admit(first)).admitted
    await limiter.settle(first, tokens=100, cost_micros=0)
    await limiter.settle(first, tokens=100, cost_micros=0)
    probe = await limiter.admit(request("r2", 1, scopes))
    assert probe.remaining_tokens == 1000 - 100 - 1


async def test_settle_can_record_more_than_reserved(limiter: Limiter) -> None:
    scopes = (("key:a", Limits(tpm=1000)),)
    first = request("r1", 100, scopes)
    assert (await limiter.admit(first)).admitted
    await limiter.settle(first, tokens=300, cost_micros=0)
    probe = await limiter.admit(request("r2", 1, scopes))
    assert probe.remaining_tokens == 1000 - 300 - 1


async def test_settle_of_an_unreserved_request_changes_nothing(limiter: Limiter) -> None:
    scopes = (("key:a", Limits(tpm=1000, max_concurrent=1)),)
    held = request("r1", 500, scopes)
    assert (await limiter.admit(held)).admitted
    # Refused, or admitted degraded: never reserved, so settling it must not refund anything.
    refused = request("r2", 400, scopes)
    assert not (await limiter.admit(refused)).admitted
    await limiter.settle(refused, tokens=0, cost_micros=0)
    await limiter.settle(request("ghost", 400, scopes), tokens=0, cost_micros=0)
    assert (await limiter.admit(request("r3", 1, scopes))).reason == "concurrency"
    await limiter.settle(held, tokens=500, cost_micros=0)
    assert (await limiter.admit(request("r3", 1, scopes))).remaining_tokens == 499


async def test_lease_frees_a_slot_that_is_never_settled(make, backend: str) -> None:
    clock = FakeClock()
    limiter = make(lease_s=1.0, clock=clock)
    scopes = (("key:a", Limits(max_concurrent=1)),)
    assert (await limiter.admit(request("crashed", 1, scopes))).admitted
    assert (await limiter.admit(request("r2", 1, scopes))).reason == "concurrency"
    if backend == "memory":
        clock.advance(1.01)
    else:
        await asyncio.sleep(1.1)
    assert (await limiter.admit(request("r2", 1, scopes))).admitted
