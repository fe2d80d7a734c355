"""LoRA requests go to a deployment that already holds the adapter, when one does: two
embedded engines (tiny random Llama) serve the same base model behind one gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.app import create_app
from gateway.deployments.base import engine_adapter_name
from tests.gateway.support import admin_key, bearer, in_process, ok, seed_tenant, settings
from tests.workers.lora.helpers import make_peft_adapter

BASE = "tiny"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_llama_path) -> Path:
    return make_peft_adapter(tiny_llama_path, tmp_path_factory.mktemp("peft") / "ft", seed=1,
                             r=4, target_modules=["q_proj", "v_proj"])


def engine(name: str, path: Path, price: str) -> dict[str, object]:
    return {"name": name, "model_name": BASE, "provider": "embedded", "upstream_model": str(path),
            "input_price_per_1m": price, "output_price_per_1m": price,
            "capabilities": {"adapters": True}}


@pytest.fixture
async def world(sqlite_url, tmp_path, tiny_llama_path) -> AsyncIterator[tuple[Any, ...]]:
    routing = tmp_path / "routing.yaml"
    routing.write_text(yaml.safe_dump({"deployments": [
        engine("gpu-1", tiny_llama_path, "2"), engine("gpu-2", tiny_llama_path, "1")]}))
    cfg = settings(sqlite_url, tmp_path, deployments_file=routing,
                   embedded={"device": "cpu", "kv_cache_memory": 8 << 20},
                   adapter_dir=tmp_path / "adapters")
    tenant = await seed_tenant(sqlite_url, tmp_path, name="initech")
    admin = bearer(await admin_key(sqlite_url, tmp_path))
    app = create_app(cfg)
    async with in_process(app) as client:
        yield client, tenant, admin, app


async def chat(client: httpx.AsyncClient, key: str, model: str) -> str:
    r = await client.post("/v1/chat/completions", headers={
        **bearer(key), "x-switchboard-cache": "off"}, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    return r.headers["x-switchboard-deployment"]


async def test_adapter_requests_follow_the_adapter(world, adapter_dir):
    client, tenant, admin, app = world
    ok(await client.post(f"/admin/tenants/{tenant.tenant_id}/adapters", headers=admin, json={
        "name": "ft", "base_model": BASE, "path": str(adapter_dir)}), 201)
    state = app.state.gateway
    pricier, cheaper = state.deployments.get("gpu-1"), state.deployments.get("gpu-2")
    # Plain requests go to the cheaper engine.
    assert {await chat(client, tenant.key, BASE) for _ in range(3)} == {"gpu-2"}
    # Registering loaded it on both; with only the pricier engine holding it, requests for it
    # go there, and stay there.
    name = engine_adapter_name(tenant.tenant_id, "ft")
    await cheaper.unload_adapter(name)
    assert pricier.adapter_residency(name) in ("cpu", "device")
    assert cheaper.adapter_residency(name) is None
    assert [await chat(client, tenant.key, f"{BASE}:ft") for _ in range(4)] == ["gpu-1"] * 4
    assert pricier.adapter_residency(name) == "device"
    assert cheaper.adapter_residency(name) is None
    # Plain requests still go by price.
    assert await chat(client, tenant.key, BASE) == "gpu-2"


async def test_an_adapter_nobody_holds_lands_once_and_sticks(world, adapter_dir):
    client, tenant, admin, app = world
    ok(await client.post(f"/admin/tenants/{tenant.tenant_id}/adapters", headers=admin, json={
        "name": "ft", "base_model": BASE, "path": str(adapter_dir)}), 201)
    name = engine_adapter_name(tenant.tenant_id, "ft")
    for deployment in app.state.gateway.deployments.deployments():
        await deployment.unload_adapter(name)
    first = await chat(client, tenant.key, f"{BASE}:ft")
    assert first == "gpu-2"  # the cheaper one registers it on first use
    assert [await chat(client, tenant.key, f"{BASE}:ft") for _ in range(3)] == [first] * 3
    other = app.state.gateway.deployments.get("gpu-1")
    assert other.adapter_residency(name) is None
