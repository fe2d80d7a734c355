"""Limits and budgets as the gateway applies them: 429s with headers, reserve and reconcile."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.gateway.support import (
    bearer,
    gateway_client,
    mock_deployment,
    mock_settings,
    seed_tenant,
    settings,
    write_deployments,
)

CHAT = [{"role": "user", "content": "Hello there"}]


def body(**extra):
    return {"model": "mock-model", "messages": CHAT, "max_tokens": 20, **extra}


@pytest.fixture(params=["memory", "redis"])
def limiter_url(request) -> str:
    return "" if request.param == "memory" else "redis://127.0.0.1:6379/0"


async def make_client(db_url, tmp_path, upstream, *, redis_url="", fail_open=True, **dep):
    cfg = settings(db_url, tmp_path, redis_url=redis_url, redis_fail_open=fail_open,
                   deployments_file=write_deployments(
                       tmp_path, [mock_deployment(upstream.base_url, **dep)]))
    return gateway_client(cfg)


async def test_rpm_refusal_carries_headers(sqlite_url, tmp_path, mock_upstream, limiter_url):
    t = await seed_tenant(sqlite_url, tmp_path, name="rpm", plan={"rpm": 3})
    async with await make_client(sqlite_url, tmp_path, mock_upstream,
                                 redis_url=limiter_url) as gw:
        statuses = [(await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key)))
                    for _ in range(5)]
    assert [r.status_code for r in statuses] == [200, 200, 200, 429, 429]
    assert statuses[2].headers["x-ratelimit-remaining-requests"] == "0"
    refused = statuses[3]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.headers["x-request-id"]


async def test_key_limit_refusal_reserves_nothing_for_tenant(sqlite_url, tmp_path, mock_upstream):
    t = await seed_tenant(sqlite_url, tmp_path, name="keyrpm", plan={"rpm": 4},
                          key={"rpm": 1})
    async with await make_client(sqlite_url, tmp_path, mock_upstream) as gw:
        first = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
        for _ in range(5):  # refused at the key: the tenant's count must not move
            r = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
            assert r.status_code == 429
    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-requests"] == "0"  # the key's, the tightest


async def test_tpm_reserves_max_then_refunds(sqlite_url, tmp_path, mock_upstream, limiter_url):
    # The mock answers with a handful of tokens; max_tokens reserves 1000 until it ends.
    t = await seed_tenant(sqlite_url, tmp_path, name="tpm", plan={"tpm": 2500})
    async with await make_client(sqlite_url, tmp_path, mock_upstream,
                                 redis_url=limiter_url) as gw:
        for _ in range(6):  # 6 x 1000 reserved would be refused if nothing were refunded
            r = await gw.post("/v1/chat/completions", json=body(max_tokens=1000),
                              headers=bearer(t.key))
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)  # settling runs just after the response
        too_big = await gw.post("/v1/chat/completions", json=body(max_tokens=3000),
                                headers=bearer(t.key))
    assert too_big.status_code == 429 and too_big.json()["error"]["type"] == "tpm"


async def test_budget_is_enforced(sqlite_url, tmp_path, mock_upstream, limiter_url):
    # Prices: 1 USD / 1M input, 2 USD / 1M output -> a 20-token cap reserves ~40 micro-USD.
    t = await seed_tenant(sqlite_url, tmp_path, name="budget", plan={"budget_micros": 200})
    async with await make_client(sqlite_url, tmp_path, mock_upstream,
                                 redis_url=limiter_url) as gw:
        results = await asyncio.gather(*[
            gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
            for _ in range(30)])
        ok = [r for r in results if r.status_code == 200]
        refused = [r for r in results if r.status_code == 429]
        assert ok and refused and len(ok) + len(refused) == 30
        assert refused[0].json()["error"]["code"] == "insufficient_quota"
        assert refused[0].json()["error"]["type"] == "insufficient_quota"
        await asyncio.sleep(0.3)
        usage = (await gw.get("/v1/usage", headers=bearer(t.key))).json()
    spent = sum(m["cost_micros"] for m in usage["models"])
    # At most one request's maximum cost past the cap.
    assert spent <= 200 + 20 * 2 + 20


async def test_concurrency_limit(sqlite_url, tmp_path, limiter_url):
    from tests.gateway.support import MockUpstream

    slow = MockUpstream("--delay-ms", "300").start()
    try:
        t = await seed_tenant(sqlite_url, tmp_path, name="conc", plan={"max_concurrent": 2})
        async with await make_client(sqlite_url, tmp_path, slow, redis_url=limiter_url) as gw:
            results = await asyncio.gather(*[
                gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
                for _ in range(6)])
            assert sorted(r.status_code for r in results) == [200, 200, 429, 429, 429, 429]
            await asyncio.sleep(0.1)
            again = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
            assert again.status_code == 200  # the slots came back when the requests ended
    finally:
        slow.stop()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends


@pytest.mark.parametrize(("fail_open", "status"), [(True, 200), (False, 503)])
async def test_redis_unreachable(sqlite_url, tmp_path, mock_upstream, fail_open, status):
    t = await seed_tenant(sqlite_url, tmp_path, name="outage", plan={"rpm": 100})
    url = f"redis://127.0.0.1:{closed_port()}/0"
    async with await make_client(sqlite_url, tmp_path, mock_upstream, redis_url=url,
                                 fail_open=fail_open) as gw:
        r = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
        assert r.status_code == status, r.text
        if status == 503:
            assert r.json()["error"]["code"] == "limiter_unavailable"
        health = await gw.get("/health")
        assert health.status_code == 200  # the gateway stays up either way


async def test_budget_survives_a_restart(sqlite_url, tmp_path, mock_upstream, limiter_url):
    t = await seed_tenant(sqlite_url, tmp_path, name="restart", plan={"budget_micros": 100})
    async with await make_client(sqlite_url, tmp_path, mock_upstream,
                                 redis_url=limiter_url) as gw:
        for _ in range(20):
            r = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
            if r.status_code == 429:
                break
            await asyncio.sleep(0.02)
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
    if limiter_url:  # as if Redis had lost its data too: only the database remembers
        import redis.asyncio as redis

        client = redis.from_url(limiter_url)
        async for key in client.scan_iter(match=f"sb:rl*bud:*tenant:{t.tenant_id}"):
            await client.delete(key)
        await client.aclose()
    async with await make_client(sqlite_url, tmp_path, mock_upstream,
                                 redis_url=limiter_url) as gw:
        r = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"


async def test_a_counter_that_lost_spend_catches_up_with_the_ledger(sqlite_url, tmp_path,
                                                                    mock_upstream):
    """Redis loses the budget counter while the gateway runs (a flush, a failover): the
    reconciler raises it back to what the ledger billed, and the budget bites again."""
    import redis.asyncio as redis

    url = "redis://127.0.0.1:6379/0"
    t = await seed_tenant(sqlite_url, tmp_path, name="lost", plan={"budget_micros": 100})
    cfg = mock_settings(sqlite_url, tmp_path, mock_upstream.base_url, redis_url=url,
                        budget_reconcile_interval_s=0.2)
    async with gateway_client(cfg) as gw:
        for _ in range(20):
            r = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
            if r.status_code == 429:
                break
            await asyncio.sleep(0.05)  # settled: the counter holds spend, not reservations
        assert r.json()["error"]["code"] == "insufficient_quota"
        client = redis.from_url(url)
        async for key in client.scan_iter(match=f"sb:rl*bud:*tenant:{t.tenant_id}"):
            await client.delete(key)
        await client.aclose()
        r = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
        assert r.status_code == 200  # the counter forgot: one more gets through
        await asyncio.sleep(0.8)  # usage flushed, then reconciled from the ledger
        r = await gw.post("/v1/chat/completions", json=body(), headers=bearer(t.key))
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
