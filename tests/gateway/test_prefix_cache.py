"""The embedded engine's prefix cache through the gateway: reported, and never shared
between tenants (one tenant's prompts never warm, or time, another's)."""

from __future__ import annotations

from tests.gateway.support import bearer, gateway_client, seed_tenant, settings
from workers.async_engine import AsyncLLMEngine

SYSTEM = "You are a careful assistant. " * 20  # about a hundred tokens: several full blocks


async def test_cached_tokens_are_reported_per_tenant(sqlite_url, tmp_path, tiny_llama_path):
    a = await seed_tenant(sqlite_url, tmp_path, name="a")
    b = await seed_tenant(sqlite_url, tmp_path, name="b")
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny"})

    async def ask(client, key: str, question: str) -> dict:
        r = await client.post("/v1/chat/completions", headers=bearer(key), json={
            "model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text
        return r.json()

    async with gateway_client(cfg, engine=engine) as client:
        first = await ask(client, a.key, "What is one plus one?")
        again = await ask(client, a.key, "What is two plus two?")
        other = await ask(client, b.key, "What is one plus one?")
        stream = await client.post("/v1/chat/completions", headers=bearer(b.key), json={
            "model": "tiny", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "And three?"}]})
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again, other)]
    assert cached[0] == 0 and cached[1] >= 96  # a's own prefix, computed once
    assert cached[2] == 0  # b shares the same prompt text but never a's cache
    assert first["choices"][0]["message"] == other["choices"][0]["message"]
    assert '"prompt_tokens_details":{"cached_tokens":' in stream.text
    assert '"cached_tokens":0}' not in stream.text  # b's second request hits b's own cache


async def test_shared_prefix_cache_is_an_explicit_setting(sqlite_url, tmp_path, tiny_llama_path):
    a = await seed_tenant(sqlite_url, tmp_path, name="a")
    b = await seed_tenant(sqlite_url, tmp_path, name="b")
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny", "shared_prefix_cache": True})
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]}
    async with gateway_client(cfg, engine=engine) as client:
        await client.post("/v1/chat/completions", headers=bearer(a.key), json=body)
        r = await client.post("/v1/chat/completions", headers=bearer(b.key), json=body)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
