"""The async engine: streams, abort on disconnect, and the overload error."""

from __future__ import annotations

import asyncio

import pytest

from tests.devices import DEVICES
from tests.workers.test_llm_tiny import random_prompts
from workers import AsyncLLMEngine, EngineOverloadedError, LLMEngine, SamplingParams


@pytest.fixture(params=DEVICES)
async def engine(request, tiny_llama_path):
    """On the CPU, and on CUDA in the engine's default there (bfloat16)."""
    core = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=8 << 20,
                               max_waiting=4, device=request.param)
    engine = AsyncLLMEngine.from_engine(core)
    await engine.start()
    yield engine
    await engine.shutdown()


def long_params(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def test_stream_grows_token_by_token_and_matches_offline(engine, tiny_llama_path):
    prompt = random_prompts(1, seed=21)[0]
    seen = []
    async for out in engine.generate(prompt, long_params(12), request_id="s1"):
        seen.append(list(out.token_ids))
    assert [len(ids) for ids in seen] == list(range(1, 13))
    assert seen[-1][:5] == seen[4]
    assert out.finished and out.finish_reason == "length"
    assert out.metrics.ttft is not None and out.metrics.tpot is not None
    assert out.metrics.queue_time is not None and out.metrics.num_generation_tokens == 12
    again = [o async for o in engine.generate(prompt, long_params(12))][-1]
    assert again.token_ids == seen[-1]


async def test_delta_outputs_add_up_to_the_cumulative_ones(engine):
    """`output_kind="delta"`: each output holds only what is new (text, tokens, logprobs),
    n samples included, and together they are the cumulative answer."""
    prompt = random_prompts(1, seed=23)[0]
    params = dict(temperature=0.8, seed=5, n=2, max_tokens=10, ignore_eos=True, logprobs=2)
    cumulative = [o async for o in engine.generate(prompt, SamplingParams(**params))][-1]
    text, tokens, logprobs = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    steps = 0
    async for out in engine.generate(prompt, SamplingParams(**params, output_kind="delta")):
        steps += 1
        for c in out.outputs:
            assert len(c.token_ids) <= 1  # one new token per sample per step, never a copy
            text[c.index] += c.text
            tokens[c.index] += c.token_ids
            logprobs[c.index] += c.logprobs
    assert steps >= 10
    for c in cumulative.outputs:
        assert (text[c.index], tokens[c.index]) == (c.text, c.token_ids)
        assert [e.token_id for e in logprobs[c.index]] == c.token_ids


async def test_concurrent_streams_are_batched_and_all_finish(engine):
    prompts = random_prompts(4, seed=22)

    async def run(i: int) -> list[int]:
        last = None
        async for out in engine.generate(prompts[i], long_params(16), request_id=f"c{i}"):
            last = out
        return last.token_ids

    results = await asyncio.gather(*(run(i) for i in range(4)))
    assert all(len(r) == 16 for r in results)
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


async def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    prompt = random_prompts(1, seed=23)[0]
    bm = engine.engine.block_manager
    stream = engine.generate(prompt, long_params(500), request_id="gone")
    async for out in stream:
        if len(out.token_ids) == 3:
            break
    await stream.aclose()  # what a disconnecting HTTP client does to the generator
    for _ in range(200):
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not engine.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks


async def test_explicit_abort_ends_work(engine):
    prompt = random_prompts(1, seed=24)[0]
    got = []

    async def consume():
        async for out in engine.generate(prompt, long_params(500), request_id="ab"):
            got.append(out)

    task = asyncio.create_task(consume())
    while len(got) < 2:
        await asyncio.sleep(0.005)
    await engine.abort("ab")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not engine.engine.has_unfinished_requests()
    assert len(got[-1].token_ids) < 500


async def test_full_waiting_queue_is_refused_with_overloaded(tiny_llama_path):
    core = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=8 << 20,
                               max_waiting=2, max_num_seqs=1)
    engine = AsyncLLMEngine.from_engine(core)
    await engine.start()
    prompts = random_prompts(4, seed=25)

    async def consume(prompt):
        return [o async for o in engine.generate(prompt, long_params(300))][-1]

    async def until(running: int, waiting: int) -> None:
        for _ in range(500):
            if (len(core.scheduler.running), len(core.scheduler.waiting)) == (running, waiting):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("engine never reached the expected queue state")

    tasks = [asyncio.create_task(consume(prompts[0]))]
    await until(1, 0)
    tasks += [asyncio.create_task(consume(p)) for p in prompts[1:3]]
    await until(1, 2)  # one runs (max_num_seqs=1), two wait: the queue is full
    with pytest.raises(EngineOverloadedError, match="overloaded"):
        await engine.generate(prompts[3], long_params(4)).__anext__()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not core.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    await engine.shutdown()
