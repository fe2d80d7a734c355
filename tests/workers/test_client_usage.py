"""A request that ends before its first token still reports the prompt work the engine did,
so the gateway bills it (issue: aborted 2,869-token prompts passed a TPM limit for free)."""

from __future__ import annotations

import asyncio
import time

import pytest

from workers import AsyncLLMEngine, LLMEngine
from workers.client import EmbeddedClient

CHUNK = 32


@pytest.fixture
async def client(tiny_llama_path):
    core = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=16 << 20,
                               max_num_batched_tokens=CHUNK)
    slow_steps(core)
    engine = AsyncLLMEngine.from_engine(core)
    await engine.start()
    yield EmbeddedClient(engine, "tiny")
    await engine.shutdown()


def slow_steps(core: LLMEngine, seconds: float = 0.01) -> None:
    """A model this small steps in a millisecond or two on a fast CPU: slow each step so a
    test can reliably act mid-prefill (this is about what is billed, not about speed)."""
    execute = core.runner.execute

    def slower(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)

    core.runner.execute = slower


def long_prompt() -> dict:
    return {"prompt": list(range(100, 100 + 24 * CHUNK)), "max_tokens": 4, "temperature": 0}


async def progressed(call, at_least: int) -> None:
    while call.request.progress.num_computed_tokens < at_least:
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("stream", [False, True])
async def test_leaving_mid_prefill_reports_the_prompt_computed(client, stream):
    call = client.prepare(long_prompt(), chat=False)
    if stream:
        async def read() -> None:
            async for _ in client.events(call, request_id="s"):
                pass

        work = asyncio.ensure_future(read())
    else:
        work = asyncio.ensure_future(client.complete(call, request_id="c"))
    await progressed(call, 3 * CHUNK)
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    usage = call.usage
    assert usage.completion_tokens == 0 and not usage.finished
    computed = usage.computed_prompt_tokens
    assert computed is not None and 3 * CHUNK <= computed < usage.prompt_tokens
    assert computed % CHUNK == 0  # whole scheduled chunks, nothing guessed
    engine = client.engine.engine
    await asyncio.sleep(0.1)  # the abort is applied between steps
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


async def test_a_finished_request_reports_its_whole_prompt(client):
    call = client.prepare({"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0},
                          chat=False)
    await client.complete(call, request_id="done")
    assert call.usage.computed_prompt_tokens == call.usage.prompt_tokens == 4
