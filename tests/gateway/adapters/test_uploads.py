"""Uploaded adapters: malformed configs and non-finite weights are a 400 that leaves nothing
behind, and the upload folders are owner-only."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.gateway.support import assert_error, bearer, gateway_client, seed_tenant, settings
from tests.workers.lora.helpers import make_peft_adapter
from workers.async_engine import AsyncLLMEngine

BASE = "tiny"


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory, tiny_llama_path) -> Path:
    return make_peft_adapter(tiny_llama_path, tmp_path_factory.mktemp("peft") / "good", r=4,
                             target_modules=["q_proj", "v_proj"])


def files(config: bytes, weights: bytes) -> dict[str, tuple[str, bytes]]:
    return {"adapter_config": ("adapter_config.json", config),
            "adapter_model": ("adapter_model.safetensors", weights)}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def nan_weights(folder: Path, out: Path) -> bytes:
    weights = load_file(folder / "adapter_model.safetensors")
    weights[sorted(weights)[0]][0, 0] = float("nan")
    save_file(weights, out)
    return out.read_bytes()


async def test_bad_configs_and_weights_are_400_and_good_uploads_are_private(
        sqlite_url, tmp_path, tiny_llama_path, good_adapter):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="uploader")
    adapter_dir = tmp_path / "adapters"
    cfg = settings(sqlite_url, tmp_path, embedded={"name": BASE}, adapter_dir=adapter_dir)
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=8 << 20,
                            enable_lora=True, max_loras=2, max_lora_rank=8)
    config = json.loads((good_adapter / "adapter_config.json").read_text())
    weights = (good_adapter / "adapter_model.safetensors").read_bytes()
    bad = {
        "alpha-text": (json.dumps({**config, "lora_alpha": "abc"}).encode(), weights),
        "alpha-nan": (json.dumps({**config, "lora_alpha": float("nan")}).encode(), weights),
        "alpha-huge": (json.dumps({**config, "lora_alpha": 1e300}).encode(), weights),
        "weights-nan": (json.dumps(config).encode(),
                        nan_weights(good_adapter, tmp_path / "nan.safetensors")),
    }
    async with gateway_client(cfg, engine=engine) as client:
        for name, (config_bytes, weight_bytes) in bad.items():
            r = await client.post("/v1/adapters/upload", headers=bearer(tenant.key),
                                  files=files(config_bytes, weight_bytes),
                                  data={"base_model": BASE, "name": name})
            assert_error(r, 400, code="invalid_adapter")
        assert [p for p in adapter_dir.rglob("*") if p.is_file()] == []  # nothing left
        r = await client.post("/v1/adapters/upload", headers=bearer(tenant.key),
                              files=files(json.dumps(config).encode(), weights),
                              data={"base_model": BASE, "name": "fine"})
        assert r.status_code == 201, r.text
    stored = [p for p in adapter_dir.rglob("*") if p.is_file()]
    assert len(stored) == 2
    assert {mode(p) for p in stored} == {0o600}
    folders = {adapter_dir, adapter_dir / tenant.tenant_id, stored[0].parent}
    assert {mode(p) for p in folders} == {0o700}
