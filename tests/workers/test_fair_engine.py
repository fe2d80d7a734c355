"""Two tenants on the real engine (tiny random Llama): a heavy backlog does not hold back a
light tenant, and while both are backlogged the tokens served split by weight."""

from __future__ import annotations

import pytest

from tests.workers.test_llm_tiny import random_prompts
from workers import LLMEngine, SamplingParams


def params(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def admission_order(engine: LLMEngine) -> list[str]:
    """Run to completion; request ids in the order their first output token came out."""
    order: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in order and out.token_ids:
                order.append(out.request_id)
    return order


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_light_tenant_is_not_queued_behind_a_heavy_backlog(tiny_llama_path, policy):
    engine = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=8 << 20,
                                 device="cpu", dtype="float32", max_num_seqs=2,
                                 scheduling_policy=policy)
    prompts = random_prompts(12, seed=5, lo=8, hi=16)
    for i, prompt in enumerate(prompts[:10]):
        engine.add_request(f"heavy-{i}", prompt, params(), tenant="heavy")
    for i, prompt in enumerate(prompts[10:]):
        engine.add_request(f"light-{i}", prompt, params(), tenant="light")
    order = admission_order(engine)
    light = [order.index(f"light-{i}") for i in range(2)]
    if policy == "fair":
        # the light tenant's first request runs beside the heavy one's first (the heavy
        # tenant was charged its prompt), and its second takes the next free slot
        assert light == [1, 2]
    else:
        assert light == [10, 11]
    tokens = engine.tenant_tokens()  # computed: the prompt, then each output but the last
    assert tokens["light"] == sum(len(p) for p in prompts[10:]) + 2 * 7
    assert tokens["heavy"] == sum(len(p) for p in prompts[:10]) + 10 * 7


@pytest.mark.parametrize(("weights", "share"), [((1.0, 1.0), 0.5), ((3.0, 1.0), 0.75)])
def test_backlogged_tenants_split_tokens_by_weight(tiny_llama_path, weights, share):
    """Both tenants keep a backlog (30 requests each, 4 run at once): over the steps while
    both still wait, A's part of the tokens is its weight's share, within 10%."""
    engine = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=8 << 20,
                                 device="cpu", dtype="float32", max_num_seqs=4)
    prompts = random_prompts(60, seed=9, lo=6, hi=12)
    for i in range(30):
        engine.add_request(f"a-{i}", prompts[2 * i], params(12), tenant="a", weight=weights[0])
        engine.add_request(f"b-{i}", prompts[2 * i + 1], params(12), tenant="b",
                           weight=weights[1])
    start = engine.tenant_tokens()
    last = start
    while True:
        waiting = {seq.tenant for seq in engine.scheduler.waiting}
        if waiting != {"a", "b"}:
            break
        last = engine.tenant_tokens()
        engine.step()
    served_a = last.get("a", 0) - start.get("a", 0)
    served_b = last.get("b", 0) - start.get("b", 0)
    assert served_a + served_b > 200  # long enough a window to mean something
    assert served_a / (served_a + served_b) == pytest.approx(share, rel=0.10)


def test_the_engine_times_its_steps_and_limits_a_shared_step(tiny_llama_path):
    """The engine feeds each step's time to the scheduler; with two tenants active and a
    limit far below one step, a long prompt advances by the 16-token floor per step, while a
    lone tenant's prompt is not limited."""
    engine = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=8 << 20,
                                 device="cpu", dtype="float32", max_num_batched_tokens=256,
                                 shared_step_s=1e-9)
    scheduler = engine.scheduler
    assert scheduler.cost.attention_tokens > 0  # from the model's config
    engine.add_request("warm", random_prompts(1, seed=1, lo=64, hi=64)[0], params(2),
                       tenant="a")
    first = scheduler.schedule  # watch the chunk sizes of the next steps
    sizes: list[int] = []

    def recording():
        out = first()
        sizes.extend(c.num_tokens for c in out.chunks if c.num_tokens > 1)
        return out

    scheduler.schedule = recording
    admission_order(engine)
    assert sizes == [64]  # alone: one chunk; meanwhile the steps were timed
    assert scheduler.cost.seconds_per_unit is not None
    sizes.clear()
    engine.add_request("other", random_prompts(1, seed=2, lo=8, hi=8)[0], params(2),
                       tenant="b")
    engine.add_request("long", random_prompts(1, seed=3, lo=100, hi=100)[0], params(2),
                       tenant="a")
    admission_order(engine)
    assert sizes[0] == 8 and max(sizes[1:]) == 16 and sum(sizes[1:]) == 100
