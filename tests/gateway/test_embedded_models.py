"""Several models embedded in one process (issue 37, section 5): each its own engine and KV
budget, routed by name and tier like any deployment, listed by /v1/models."""

from __future__ import annotations

from decimal import Decimal

from tests.conftest import build_tiny_llama
from tests.gateway.support import bearer, gateway_client, ok, seed_tenant, settings


async def test_two_embedded_models_are_two_deployments(sqlite_url, tmp_path, tokenizer):
    small = build_tiny_llama(tmp_path / "small", tokenizer)
    large = build_tiny_llama(tmp_path / "large", tokenizer, num_hidden_layers=4)
    tenant = await seed_tenant(sqlite_url, tmp_path, name="tiers")
    cfg = settings(sqlite_url, tmp_path, embedded_models=[
        {"model": str(small), "name": "small", "tier": "economy", "kv_cache_memory": 4 << 20,
         "input_price_per_1m": Decimal("0.01")},
        {"model": str(large), "name": "large", "tier": "standard", "kv_cache_memory": 8 << 20,
         "enable_lora": False}])
    async with gateway_client(cfg) as client:
        client.headers.update(bearer(tenant.key))
        gw = client._transport.app.state.gateway
        names = {d.name: d for d in gw.deployments.deployments()}
        assert {"embedded-small", "embedded-large"} <= set(names)
        small_engine = names["embedded-small"].engine.engine
        large_engine = names["embedded-large"].engine.engine
        assert small_engine is not large_engine  # an engine and a KV pool each
        assert small_engine.runner.num_blocks != large_engine.runner.num_blocks
        models = {m["id"] for m in ok(await client.get("/v1/models"))["data"]}
        assert {"small", "large"} <= models
        for name in ("small", "large"):
            r = await client.post("/v1/chat/completions", json={
                "model": name, "max_tokens": 3, "temperature": 0,
                "messages": [{"role": "user", "content": "hi"}]})
            assert ok(r)["model"] == name
            assert r.headers["x-switchboard-deployment"] == f"embedded-{name}"
        tiered = await client.post("/v1/chat/completions", headers={
            "x-switchboard-tier": "standard"}, json={
            "model": "auto", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert tiered.headers["x-switchboard-deployment"] == "embedded-large"
