"""Background work on the real engine (tiny random Llama): live requests arriving under memory
pressure preempt a batch's lines, never each other, and every preempted line resumes to the
very tokens it gives without preemption."""

from __future__ import annotations

from tests.workers.test_llm_tiny import CPU32, greedy, random_prompts
from workers import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.sequence import BACKGROUND_PRIORITY

TEN_BLOCKS = 10 * 16 * 2 * 3 * 2 * 16 * 4  # pool bytes for 10 blocks of 16 (test_llm_tiny)


def finish(engine: LLMEngine, outputs: dict[str, RequestOutput], steps: int = 10_000) -> None:
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            return
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    raise AssertionError("the engine did not finish")


def test_preempted_lines_resume_to_the_same_tokens(tiny_llama_path):
    prompts = random_prompts(6, seed=3, lo=30, hi=40)
    lines, live = prompts[:4], prompts[4:]
    solo = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=8 << 20, **CPU32)
    expected: dict[str, RequestOutput] = {}
    for i, prompt in enumerate(prompts):
        solo.add_request(f"r{i}", prompt, greedy())
    finish(solo, expected)

    # four lines of up to 64 tokens each want 16 blocks of 16: the pool has 10
    engine = LLMEngine.from_args(model=str(tiny_llama_path), block_size=16,
                                 kv_cache_memory=TEN_BLOCKS, **CPU32)
    assert engine.runner.num_blocks == 10
    outputs: dict[str, RequestOutput] = {}
    for i, prompt in enumerate(lines):
        engine.add_request(f"r{i}", prompt, greedy(), priority=BACKGROUND_PRIORITY,
                           tenant="batch")
    for _ in range(4):
        engine.step()
    for i, prompt in enumerate(live, start=len(lines)):
        engine.add_request(f"r{i}", prompt, greedy(), tenant="live")
    finish(engine, outputs)

    assert {k: o.token_ids for k, o in outputs.items()} == {
        k: o.token_ids for k, o in expected.items()}
    assert sum(outputs[f"r{i}"].metrics.num_preemptions for i in range(len(lines))) > 0
    assert all(outputs[f"r{i}"].metrics.num_preemptions == 0
               for i in range(len(lines), len(prompts)))
    assert engine.block_manager.num_free_blocks == 10


def test_background_decode_slots_is_an_engine_argument(tiny_llama_path):
    engine = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=4 << 20,
                                 background_decode_slots=3, **CPU32)
    assert engine.scheduler.config.background_decode_slots == 3
