"""The workers page shows every kind of deployment with the figures that kind reports, and
assumes none it does not: the embedded engine (queue, KV, prefix cache, adapters), the
in-process embedding model (its batcher's queued rows only), a remote worker (engine figures
and whether it answers) and an HTTP upstream (none)."""

from __future__ import annotations

import re

from gateway.console.routes.deployments import figures
from tests.gateway.console.support import console
from tests.gateway.support import free_port, mock_deployment, write_deployments
from workers.async_engine import AsyncLLMEngine


def _card(html: str, name: str) -> str:
    match = re.search(rf'<section class="card worker" data-worker="{re.escape(name)}".*?'
                      r"</section>", html, re.S)
    assert match, f"no card for {name}"
    return match.group(0)


def _stats(card: str) -> set[str]:
    return set(re.findall(r'data-stat="([^"]+)"', card))


async def test_every_kind_of_deployment_renders(sqlite_url, tmp_path, tiny_llama_path):
    routing = write_deployments(tmp_path, [
        mock_deployment(f"http://127.0.0.1:{free_port()}/v1"),  # never called: no figures
        {"name": "far", "model_name": "far-model", "provider": "worker",
         "base_url": f"http://127.0.0.1:{free_port()}"},  # nothing listens: unreachable
    ])
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20)
    async with console(sqlite_url, tmp_path, engine=engine, embedded={"name": "tiny"},
                       embedding_model="default", deployments_file=routing) as c:
        for path in ("/console/workers", "/console/workers/panel"):
            r = await c.client.get(path)
            assert r.status_code == 200, r.text
            html = r.text
            assert 'id="workers-panel"' in html and "Internal Server Error" not in html

            engine_card = _card(html, "embedded")
            assert 'data-kind="embedded engine"' in engine_card
            assert {"num_waiting", "num_running", "kv_cache_usage",
                    "prefix_cache_hit_rate"} <= _stats(engine_card)
            assert "<meter" in engine_card

            embedding = _card(html, "embedded-embedding")
            assert 'data-kind="embedding model"' in embedding and "all-minilm-l6-v2" in embedding
            assert _stats(embedding) == {"queued_rows"}
            assert '<dd data-stat="queued_rows">0</dd>' in embedding
            assert "<meter" not in embedding  # it has no KV cache

            worker = _card(html, "far")
            assert 'data-kind="remote worker"' in worker and 'data-state="unreachable"' in worker
            assert {"num_waiting", "in_flight", "kv_cache_usage"} <= _stats(worker)

            upstream = _card(html, "mock")
            assert 'data-kind="HTTP upstream"' in upstream and not _stats(upstream)
            assert "data-no-figures" in upstream and "<meter" not in upstream


def test_figures_show_only_the_numbers_a_deployment_reports():
    assert figures({}) == []
    assert figures({"queued_rows": 3.0}) == [("queued_rows", "Queued rows", "3")]
    shown = figures({"kv_cache_usage": 0.25, "num_waiting": 2, "reachable": 1.0,
                     "num_running": "many", "num_preemptions": True, "unknown": 7})
    assert shown == [("num_waiting", "Queue depth", "2"),
                     ("kv_cache_usage", "KV cache use", "25.0%")]
