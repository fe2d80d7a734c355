"""Adapters and workers pages on the real embedded engine (a tiny random Llama and a real
peft adapter): register by path and by upload, load, unload, delete, residency, and the
workers panel's live engine figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.gateway.console.support import console
from tests.workers.lora.helpers import make_peft_adapter
from workers.async_engine import AsyncLLMEngine
from workers.engine.sampling_params import SamplingParams

BASE = "tiny"


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory, tiny_llama_path) -> Path:
    return make_peft_adapter(tiny_llama_path, tmp_path_factory.mktemp("peft") / "good",
                             seed=1, r=8, target_modules=["q_proj", "v_proj"])


def _residency(html: str, name: str) -> str:
    row = html.split(f"<strong>{name}</strong>", 1)[1]
    return re.search(r'class="badge tier-(\w+)"', row).group(1)


async def test_adapters_and_workers_pages(sqlite_url, tmp_path, tiny_llama_path, peft_dir):
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20,
                            enable_lora=True, max_loras=4, max_lora_rank=16)
    async with console(sqlite_url, tmp_path, engine=engine, embedded={"name": BASE},
                       adapter_dir=tmp_path / "adapters") as c:
        r = await c.post("/console/tenants", {"name": "acme", "plan_id": "__new__"})
        tenant_id = r.headers["location"].rsplit("/", 1)[1]
        base = f"/console/tenants/{tenant_id}/adapters"
        page = (await c.client.get(base)).text
        assert "No deployment serves" not in page
        assert f'<option value="{BASE}">{BASE}</option>' in page.replace(" selected", "")

        r = await c.post(base, {"name": "bypath", "base_model": BASE, "path": str(peft_dir)})
        assert r.status_code == 303, r.text
        files = {"adapter_config": ("adapter_config.json",
                                    (peft_dir / "adapter_config.json").read_bytes()),
                 "adapter_model": ("adapter_model.safetensors",
                                   (peft_dir / "adapter_model.safetensors").read_bytes())}
        r = await c.post(f"{base}/upload", {"name": "uploaded", "base_model": BASE,
                                            "alias": "up"}, files=files)
        assert r.status_code == 303, r.text
        r = await c.post(f"{base}/upload", {"name": "uploaded", "base_model": BASE},
                         files=files)
        assert r.status_code == 400 and "already" in r.text  # the service's 409, inline

        page = (await c.client.get(base)).text
        assert _residency(page, "bypath") in ("device", "cpu", "disk")
        assert (await c.post(f"{base}/bypath/unload")).status_code == 303
        assert _residency((await c.client.get(base)).text, "bypath") == "unloaded"
        assert (await c.post(f"{base}/bypath/load")).status_code == 303
        assert _residency((await c.client.get(base)).text, "bypath") != "unloaded"

        once = SamplingParams(max_tokens=2, ignore_eos=True)
        async for _ in engine.generate([5, 6, 7], once, tenant=tenant_id):
            pass
        async for _ in engine.generate([5, 6, 7, 8, 9], once):
            pass
        panel = (await c.client.get("/console/workers/panel")).text
        assert 'data-worker="embedded"' in panel and 'data-stat="kv_cache_usage"' in panel
        # the fair share by tenant: acme's 4 tokens (3 of prompt, 1 output fed back) and the
        # anonymous request's 6, by name, most served first
        shares = re.findall(r'<tr data-tenant="([^"]+)"><td>[^<]*</td><td>(\d+)</td>', panel)
        assert shares == [("(no tenant)", "6"), ("acme", "4")]
        assert "acme/bypath" in panel and "acme/uploaded" in panel
        assert 'hx-trigger="every 2s"' in panel

        assert (await c.post(f"{base}/uploaded/delete")).status_code == 303
        page = (await c.client.get(base)).text
        assert "<strong>uploaded</strong>" not in page
        assert not list((tmp_path / "adapters").rglob("*.safetensors"))  # its files went too
        r = await c.post(f"{base}/nope/load")
        assert r.status_code == 404
