"""/stats (and the heartbeat) answer while a step is in flight, with the adapters as of the
last step: a long prefill must not make a busy worker look dead to gateways."""

from __future__ import annotations

import asyncio
import threading

from tests.workers.lora.helpers import make_peft_adapter
from workers import SamplingParams
from workers.async_engine import AsyncLLMEngine
from workers.server import WorkerOptions
from workers.server.state import WorkerState

PROMPT = [5, 17, 301, 44, 9, 1200, 77]


async def test_describe_answers_during_a_step_with_the_last_adapters(tiny_llama_path, tmp_path):
    engine = AsyncLLMEngine(str(tiny_llama_path), kv_cache_memory=8 << 20, enable_lora=True,
                            max_loras=2, max_lora_rank=16)
    await engine.start()
    state = WorkerState(engine, WorkerOptions(model_name="tiny", worker_id="w1"))
    state.ready = True
    try:
        adapter = make_peft_adapter(tiny_llama_path, tmp_path / "a", seed=3, r=8)
        await engine.add_lora("a", str(adapter))
        assert set(state.adapters_seen()) == {"a"}  # an adapter call refreshes the view

        inner = engine.engine
        assert inner is not None
        entered, release = threading.Event(), threading.Event()
        step = inner.step

        def blocked_step():
            entered.set()
            release.wait(10)
            return step()

        inner.step = blocked_step  # type: ignore[method-assign]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

        async def run() -> str:
            text = ""
            async for out in engine.generate(PROMPT, params, lora="a"):
                text = out.text
            return text

        task = asyncio.create_task(run())
        assert await asyncio.to_thread(entered.wait, 5)  # the step thread is inside a step
        described = await asyncio.wait_for(state.describe(), 1.0)
        assert described["ready"] and set(described["adapters"]) == {"a"}
        stats = described["stats"]
        assert stats["num_waiting"] + stats["num_running"] == 1  # the request in flight
        release.set()
        await asyncio.wait_for(task, 30)
    finally:
        release.set()
        await engine.shutdown()
