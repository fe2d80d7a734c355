"""Exact admission under concurrency, and all-or-nothing reservation across scopes."""

from __future__ import annotations

import asyncio
from collections import Counter

import redis

from tenancy.limits import AdmissionRequest, Decision, Limiter, Limits

BURST = 200


def request(
    n: int, scopes: tuple[tuple[str, Limits], ...], tokens: int = 1, **kw
) -> AdmissionRequest:
    return AdmissionRequest(request_id=f"r{n}", scopes=scopes, tokens=tokens, **kw)


async def burst(limiter: Limiter, scopes: tuple[tuple[str, Limits], ...], tokens: int = 1):
    decisions = await asyncio.gather(
        *(limiter.admit(request(n, scopes, tokens)) for n in range(BURST))
    )
    reasons = Counter(d.reason for d in decisions)
    assert "unavailable" not in reasons, reasons  # a silent fallback would hide a bug
    return decisions, reasons


async def test_burst_against_rpm_admits_exactly_the_limit(limiter: Limiter) -> None:
    decisions, reasons = await burst(limiter, (("key:a", Limits(rpm=50)),))
    assert reasons == {None: 50, "rpm": BURST - 50}
    refused = [d for d in decisions if not d.admitted]
    assert all(d.scope == "key:a" and 0 < d.retry_after_s <= 61 for d in refused)
    assert all(d.remaining_requests == 0 and d.limit_requests == 50 for d in refused)


async def test_burst_against_tpm_admits_exactly_the_limit(limiter: Limiter) -> None:
    _, reasons = await burst(limiter, (("key:a", Limits(tpm=1000)),), tokens=40)
    assert reasons == {None: 25, "tpm": BURST - 25}


async def test_burst_against_concurrency_admits_exactly_the_limit(limiter: Limiter) -> None:
    decisions, reasons = await burst(limiter, (("key:a", Limits(max_concurrent=7)),))
    assert reasons == {None: 7, "concurrency": BURST - 7}
    assert all(d.retry_after_s > 0 for d in decisions if not d.admitted)


async def test_burst_with_key_and_tenant_limits(limiter: Limiter) -> None:
    scopes = (("key:a", Limits(rpm=30)), ("tenant:t", Limits(rpm=50, tpm=10_000)))
    _, reasons = await burst(limiter, scopes, tokens=10)
    assert reasons == {None: 30, "rpm": BURST - 30}
    # The 170 key-level refusals reserved nothing at the tenant: 20 requests are left there.
    _, reasons = await burst(limiter, (("tenant:t", Limits(rpm=50, tpm=10_000)),), tokens=10)
    assert reasons == {None: 20, "rpm": BURST - 20}


async def test_refusal_at_key_reserves_nothing_at_tenant(limiter: Limiter) -> None:
    key = ("key:a", Limits(rpm=1))
    tenant = ("tenant:t", Limits(rpm=10, tpm=1000, max_concurrent=2))
    assert (await limiter.admit(request(1, (key, tenant), tokens=100))).admitted
    refused = await limiter.admit(request(2, (key, tenant), tokens=100))
    assert (refused.reason, refused.scope) == ("rpm", "key:a")

    # The tenant saw one request, 100 tokens and one slot; a tenant-only request shows it.
    probe = await limiter.admit(request(3, (tenant,), tokens=100))
    assert probe.admitted
    assert (probe.remaining_requests, probe.remaining_tokens) == (8, 800)
    full = await limiter.admit(request(4, (tenant,), tokens=100))
    assert (full.reason, full.scope) == ("concurrency", "tenant:t")


async def test_refusal_at_tenant_reserves_nothing_at_key(limiter: Limiter) -> None:
    key = ("key:a", Limits(rpm=10, tpm=1000, max_concurrent=5))
    tenant = ("tenant:t", Limits(max_concurrent=1))
    assert (await limiter.admit(request(1, (key, tenant), tokens=100))).admitted
    refused = await limiter.admit(request(2, (key, tenant), tokens=100))
    assert (refused.reason, refused.scope) == ("concurrency", "tenant:t")
    probe = await limiter.admit(request(3, (key,), tokens=100))
    assert (probe.remaining_requests, probe.remaining_tokens) == (8, 800)


async def test_key_refusal_leaves_tenant_keys_untouched_in_redis(
    make, backend: str, namespace: str, redis_client: redis.Redis
) -> None:
    if backend != "redis":
        return
    limiter = make()
    key = ("key:a", Limits(max_concurrent=1))
    tenant = ("tenant:t", Limits(rpm=100))
    assert (await limiter.admit(request(1, (key, tenant), tokens=5))).admitted
    prefix = f"sb:rl:{namespace}:"
    before = {kind: redis_client.hgetall(f"{prefix}{kind}:tenant:t") for kind in ("req", "tok")}
    assert sum(map(int, before["req"].values())) == 1
    assert sum(map(int, before["tok"].values())) == 5
    assert not (await limiter.admit(request(2, (key, tenant), tokens=5))).admitted
    after = {kind: redis_client.hgetall(f"{prefix}{kind}:tenant:t") for kind in ("req", "tok")}
    assert after == before
    assert redis_client.zrange(f"{prefix}run:tenant:t", 0, -1) == ["r1"]
    assert not redis_client.exists(f"{prefix}res:r2")
    # Every key expires on its own, so Redis memory stays bounded.
    for name in redis_client.scan_iter(match=f"{prefix}*"):
        assert redis_client.ttl(name) > 0, name


async def test_more_tokens_than_tpm_is_never_admitted(limiter: Limiter) -> None:
    decision = await limiter.admit(request(1, (("key:a", Limits(tpm=100)),), tokens=101))
    assert (decision.admitted, decision.reason, decision.scope) == (False, "tpm", "key:a")
    assert decision.retry_after_s > 0
    assert (await limiter.admit(request(2, (("key:a", Limits(tpm=100)),), tokens=100))).admitted


async def test_zero_limits_refuse_everything(limiter: Limiter) -> None:
    for n, (limits, reason) in enumerate(
        [(Limits(rpm=0), "rpm"), (Limits(tpm=0), "tpm"), (Limits(max_concurrent=0), "concurrency")]
    ):
        decision = await limiter.admit(request(n, ((f"key:{n}", limits),)))
        assert decision.reason == reason


async def test_unlimited_scopes_admit_and_report_no_headers(limiter: Limiter) -> None:
    decision = await limiter.admit(request(1, (("key:a", Limits()), ("tenant:t", Limits()))))
    assert decision == Decision(admitted=True)


async def test_headers_come_from_the_tightest_scope(limiter: Limiter) -> None:
    scopes = (
        ("key:a", Limits(rpm=10, tpm=5000)),
        ("tenant:t", Limits(rpm=4, tpm=100_000)),
    )
    decision = await limiter.admit(request(1, scopes, tokens=1000))
    assert decision.admitted and not decision.degraded
    assert (decision.limit_requests, decision.remaining_requests) == (4, 3)
    assert (decision.limit_tokens, decision.remaining_tokens) == (5000, 4000)
    assert decision.reset_requests_s is not None and 59 < decision.reset_requests_s <= 61
    assert decision.reset_tokens_s is not None and 59 < decision.reset_tokens_s <= 61
