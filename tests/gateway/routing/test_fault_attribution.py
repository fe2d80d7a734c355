"""A deployment is blamed only for its own faults: one tenant's long non-streamed requests are
not cut by the routing deadline, not failures, and never open the breaker for another."""

from __future__ import annotations

import asyncio
import time

from tests.gateway.support import bearer, gateway_client, seed_tenant, settings
from workers.async_engine import AsyncLLMEngine

BUDGET_S = 0.2  # time enough for a first token, well below what the long requests take (0.49 s
# for the two on a fast Zen 5)


async def test_long_requests_finish_and_never_trip_the_breaker(sqlite_url, tmp_path,
                                                                tiny_llama_path):
    heavy = await seed_tenant(sqlite_url, tmp_path, name="heavy")
    light = await seed_tenant(sqlite_url, tmp_path, name="light")
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny"},
                   route_budget_s=BUDGET_S, breaker_failure_threshold=1)

    def body(max_tokens: int) -> dict:
        return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "messages": [{"role": "user", "content": "go on"}]}

    async with gateway_client(cfg, engine=engine) as client:
        started = time.monotonic()
        replies = await asyncio.gather(*(
            client.post("/v1/chat/completions", headers=bearer(heavy.key), json=body(500))
            for _ in range(2)))
        elapsed = time.monotonic() - started
        health = client._transport.app.state.gateway.deployments.health("embedded")
        snapshot = health.breaker.snapshot()
        after = await client.post("/v1/chat/completions", headers=bearer(light.key),
                                  json=body(2))
    assert elapsed > BUDGET_S  # the deadline would have cut them, had it applied
    for reply in replies:
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 500
    assert (snapshot.state, health.failures) == ("closed", 0)
    assert health.successes == 3  # the two long ones, then the light one
    assert after.status_code == 200, after.text
