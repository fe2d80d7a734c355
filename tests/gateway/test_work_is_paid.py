"""Work done is work paid: a client that leaves while the engine is still computing its
prompt is billed for the prompt tokens computed, and its TPM settles on the same count."""

from __future__ import annotations

import asyncio
import json

from sqlalchemy import text

from tenancy.db import make_engine
from tests.gateway.support import gateway_client, seed_tenant, settings
from tests.workers.test_client_usage import slow_steps
from workers.async_engine import AsyncLLMEngine

CHUNK = 32


async def leave_when(app, key: str, body: dict, ready) -> list[dict]:
    """Call the ASGI app directly and disconnect once `ready()` says so."""
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}
        for _ in range(3000):  # at most 30 s
            if ready():
                break
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path":
             b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {key}".encode()),
                         (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 5000), "server": ("gateway", 80)}
    await app(scope, receive, send)
    return sent


async def test_a_client_leaving_mid_prefill_pays_for_the_prompt_computed(sqlite_url, tmp_path,
                                                                         tiny_llama_path):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="leaver")
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20,
                            max_num_batched_tokens=CHUNK)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny"})
    prompt = list(range(100, 100 + 24 * CHUNK))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with gateway_client(cfg, engine=engine) as client:
        app = client._transport.app
        gw = app.state.gateway
        core = engine.engine
        slow_steps(core)

        def prefilling() -> bool:  # two chunks of the prompt computed, none of the output
            return any(s.num_computed_tokens >= 2 * CHUNK for s in list(core.scheduler.running))

        sent = await leave_when(app, tenant.key, body, prefilling)
        await asyncio.gather(*gw.background)
        await gw.meter.flush()
    assert sent[0]["status"] == 499
    db = make_engine(sqlite_url)
    try:
        async with db.connect() as conn:
            rows = (await conn.execute(text(
                "select status, prompt_tokens, completion_tokens, cost_micros "
                "from usage_records"))).all()
    finally:
        await db.dispose()
    ((status, prompt_tokens, completion_tokens, cost),) = rows
    assert (status, completion_tokens) == ("aborted", 0)
    assert 0 < prompt_tokens < len(prompt) and prompt_tokens % CHUNK == 0
    assert cost > 0  # the embedded engine's input price applies to the work done
