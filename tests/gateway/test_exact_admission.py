"""TPM and budgets hold on exact token counts, for any alphabet, on both limiter backends.

The audit's burst: concurrent chats whose prompts are emoji (three tokens a character here,
where admission's cheap estimate once guessed a quarter) metered 11x the TPM and 5x the budget.
Digits still fool the estimate (a token each, guessed at four a token). Admission now reserves
the exact count before any work, so what is metered stays within the limit plus at most one
request. Served live on loopback (uvicorn), with the official client.
"""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal

import openai
import pytest
import redis
from sqlalchemy import text

from gateway.app import create_app
from tenancy.db import make_engine
from tests.gateway.support import live, seed_tenant, settings
from workers.async_engine import AsyncLLMEngine

REDIS_URL = "redis://127.0.0.1:6379/0"
BURST = 12
MAX_TOKENS = 4
# Multi-byte and ASCII: three tokens an emoji, and a token a digit where the cheap estimate
# guesses four digits a token (without the exact step, 12 digit prompts metered 3.9x the TPM).
PROMPTS = {"emoji": "😀" * 150, "digits": "0123456789" * 40}


def limiter_settings(backend: str) -> dict:
    if backend == "memory":
        return {}
    return {"redis_url": REDIS_URL, "redis_fail_open": False, "redis_timeout_s": 2.0}


async def burst(port: int, key: str, prompt: str) -> tuple[list[int], list[int]]:
    """BURST concurrent chats: (the served ones' total tokens, the refusals' statuses)."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key,
                                max_retries=0, timeout=120)

    async def one() -> int | openai.APIStatusError:
        try:
            reply = await client.chat.completions.create(
                model="tiny", max_tokens=MAX_TOKENS, temperature=0,
                messages=[{"role": "user", "content": prompt}])
        except openai.APIStatusError as exc:
            return exc
        assert reply.usage is not None
        return reply.usage.total_tokens

    try:
        results = await asyncio.gather(*(one() for _ in range(BURST)))
    finally:
        await client.close()
    served = [r for r in results if isinstance(r, int)]
    refused = [r.status_code for r in results if not isinstance(r, int)]
    return served, refused


async def metered(db_url: str) -> tuple[int, int, int]:
    """(rows, tokens, micro-USD) in the usage ledger."""
    db = make_engine(db_url)
    try:
        async with db.connect() as conn:
            row = (await conn.execute(text(
                "select count(*), coalesce(sum(prompt_tokens + completion_tokens), 0), "
                "coalesce(sum(cost_micros), 0) from usage_records"))).one()
    finally:
        await db.dispose()
    return int(row[0]), int(row[1]), int(row[2])


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def engine(tiny_llama_path) -> AsyncLLMEngine:
    return AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=64 << 20)


@pytest.fixture(autouse=True)
def no_stale_budget_keys():
    """Each test's tenant is new, so its Redis counters are too; nothing to clean but them."""
    yield
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for tenant in list(SEEN):
            for key in client.scan_iter(match=f"sb:rl:*{tenant}*", count=1000):
                client.delete(key)
    finally:
        SEEN.clear()
        client.close()


SEEN: list[str] = []


async def serve_burst(sqlite_url, tmp_path, engine, backend: str, plan: dict, prompt: str,
                      **prices) -> tuple[list[int], list[int], tuple[int, int, int]]:
    tenant = await seed_tenant(sqlite_url, tmp_path, name=f"t{uuid.uuid4().hex[:6]}",
                               plan=plan)
    SEEN.append(tenant.tenant_id)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny", **prices},
                   **limiter_settings(backend))
    app = create_app(cfg, engine=engine)
    with live(cfg, app) as port:
        served, refused = await burst(port, tenant.key, prompt)
    return served, refused, await metered(sqlite_url)


@pytest.mark.parametrize("alphabet", list(PROMPTS))
async def test_a_burst_meters_at_most_the_tpm(sqlite_url, tmp_path, engine, backend, alphabet):
    tpm = 2000
    served, refused, (rows, tokens, _) = await serve_burst(
        sqlite_url, tmp_path, engine, backend, {"tpm": tpm}, PROMPTS[alphabet])
    assert served, "at least one request fits the TPM"
    assert refused and set(refused) == {429}
    assert rows == len(served)
    # Every reservation was exact (prompt + max_tokens), so even the last one fits.
    assert tokens == sum(served) <= tpm


@pytest.mark.parametrize("alphabet", list(PROMPTS))
async def test_a_burst_overshoots_the_budget_by_at_most_one_request(
        sqlite_url, tmp_path, engine, backend, alphabet):
    cap = 2000  # micro-USD; at $1 per 1M tokens a request here costs about 450
    served, refused, (rows, _, cost) = await serve_burst(
        sqlite_url, tmp_path, engine, backend, {"budget_micros": cap}, PROMPTS[alphabet],
        input_price_per_1m=Decimal("1"), output_price_per_1m=Decimal("1"))
    assert served and refused and set(refused) == {429}
    assert rows == len(served)
    one_request = max(served)  # micro-USD per token is 1 here
    assert cost < cap + one_request
