"""Interjections on the real engine (tiny random Llama): a short request of another tenant
that arrives while a step runs is served between two of that step's layers, and neither
step's tokens change for it."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.workers.test_llm_tiny import random_prompts
from workers import AsyncLLMEngine, LLMEngine, SamplingParams
from workers.config import EngineArgs
from workers.llm_engine import DEFAULT_INTERJECT_TOKENS, _interject_tokens

LONG, SHORT = random_prompts(2, seed=41, lo=10, hi=12)
LONG = LONG * 12  # 120-132 tokens: several 32-token steps


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_engine(tiny_llama_path, **overrides) -> LLMEngine:
    args = dict(model=str(tiny_llama_path), kv_cache_memory=8 << 20, device="cpu",
                dtype="float32", max_num_batched_tokens=32, interject_tokens=64)
    return LLMEngine.from_args(**{**args, **overrides})


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = list(out.token_ids)
    return final


class Scripted:
    """Arrivals: the given requests arrive at the first layer boundary the engine offers."""

    def __init__(self, *requests: tuple[str, list[int], int, str]) -> None:
        self.pending = list(requests)
        self.published: list = []
        self.num_admits = 0

    def admit(self, engine: LLMEngine) -> None:
        self.num_admits += 1
        for request_id, prompt, max_tokens, tenant in self.pending:
            engine.add_request(request_id, prompt, params(max_tokens), tenant=tenant)
        self.pending = []

    def publish(self, outputs: list) -> None:
        self.published.extend(outputs)


@pytest.fixture(scope="module")
def solo(tiny_llama_path) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run alone."""
    tokens = {}
    for request_id, prompt, max_tokens in (("a", LONG, 6), ("b", SHORT, 5)):
        engine = make_engine(tiny_llama_path, interject_tokens=0)
        engine.add_request(request_id, prompt, params(max_tokens), tenant=request_id)
        tokens.update(run_all(engine))
    return tokens


def test_another_tenants_short_request_runs_inside_the_step(tiny_llama_path, solo):
    engine = make_engine(tiny_llama_path)
    engine.add_request("a", LONG, params(6), tenant="a")
    engine.arrivals = arrivals = Scripted(("b", SHORT, 5, "b"))
    outputs = engine.step()  # a's first 32 prompt tokens; b arrives after the first layer
    assert [o.request_id for o in outputs] == []  # a samples nothing yet
    assert [(o.request_id, len(o.token_ids)) for o in arrivals.published] == [("b", 1)]
    assert engine.num_interjections == 1 and engine.stats()["num_interjections"] == 1
    assert engine._requests["a"].samples[0].seq.num_computed_tokens == 32
    final = run_all(engine)
    assert final == solo  # neither step's tokens changed


def test_the_tenant_of_the_step_in_flight_waits_for_its_end(tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    engine.add_request("a", LONG, params(6), tenant="a")
    engine.arrivals = arrivals = Scripted(("a2", SHORT, 5, "a"))
    engine.step()
    assert arrivals.num_admits == 2 and arrivals.published == []  # at both layer boundaries
    assert engine.num_interjections == 0
    assert len(engine.scheduler.waiting) == 1  # queued, for an ordinary step


@pytest.mark.parametrize("overrides", [{"interject_tokens": 0},
                                       {"scheduling_policy": "fcfs"}])
def test_no_interjections_when_off_or_first_come_first_served(tiny_llama_path, overrides):
    engine = make_engine(tiny_llama_path, **overrides)
    engine.add_request("a", LONG, params(6), tenant="a")
    engine.arrivals = arrivals = Scripted(("b", SHORT, 5, "b"))
    engine.step()
    assert arrivals.num_admits == 0 and engine.num_interjections == 0


def test_interjections_default_on_for_cpu_only():
    cpu = SimpleNamespace(device=torch.device("cpu"))
    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert _interject_tokens(EngineArgs(), cpu) == DEFAULT_INTERJECT_TOKENS
    assert _interject_tokens(EngineArgs(), cuda) == 0
    assert _interject_tokens(EngineArgs(interject_tokens=8), cuda) == 8


async def test_a_short_request_is_answered_while_the_long_step_is_paused(
        tiny_llama_path, solo):
    """Order of events on the async engine: tenant a's step stops after its first layer
    until b's request is queued; b's first token reaches its stream while a's step is still
    paused (the step thread waits for it), and a's step then finishes as it would have."""
    core = make_engine(tiny_llama_path)
    engine = AsyncLLMEngine.from_engine(core)
    paused, queued, answered = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}
    execute = core.runner.execute

    def gated(sched, between_layers=None):
        tenants = {core._seqs[c.seq_id].tenant for c in sched.chunks}
        if between_layers is None or tenants != {"a"} or paused.is_set():
            return execute(sched, between_layers)

        def hook():
            if not paused.is_set():
                paused.set()
                seen["queued"] = queued.wait(10)
                between_layers()
                seen["answered_in_step"] = answered.wait(10)
            else:
                between_layers()
        return execute(sched, hook)

    core.runner.execute = gated
    await engine.start()
    try:
        a = asyncio.create_task(last(engine.generate(LONG, params(6), "a", tenant="a")))
        assert await asyncio.to_thread(paused.wait, 10)
        b_stream = engine.generate(SHORT, params(5), "b", tenant="b")
        first = asyncio.create_task(anext(b_stream))
        for _ in range(3):
            await asyncio.sleep(0)  # b's generator runs to its first wait: its add is queued
        queued.set()
        out = await asyncio.wait_for(first, 10)
        answered.set()
        assert len(out.token_ids) == 1
        b_final = await asyncio.wait_for(last(b_stream), 10)
        a_final = await asyncio.wait_for(a, 10)
    finally:
        await engine.shutdown()
    assert seen == {"queued": True, "answered_in_step": True}
    assert {"a": list(a_final.token_ids), "b": list(b_final.token_ids)} == solo
    assert core.num_interjections == 1


async def last(stream):
    outputs = [out async for out in stream]
    return outputs[-1]


def test_arrivals_at_a_later_layer_boundary_interject_too(tiny_llama_path):
    """b's first request interjects after the first layer; its second and c's, arriving
    after the second, interject together (b is not in the step in flight, and not ahead)."""
    engine = make_engine(tiny_llama_path)
    engine.add_request("a", LONG, params(6), tenant="a")
    engine.arrivals = arrivals = Scripted(("b", SHORT, 5, "b"))
    later = [("b2", SHORT, 5, "b"), ("c", SHORT, 5, "c")]
    admit = arrivals.admit

    def admit_then_more(engine: LLMEngine) -> None:
        admit(engine)
        arrivals.pending, later[:] = later[:], []

    arrivals.admit = admit_then_more
    engine.step()
    published = [(o.request_id, len(o.token_ids)) for o in arrivals.published]
    assert published[0] == ("b", 1) and sorted(published[1:]) == [("b2", 1), ("c", 1)]
    assert engine.num_interjections == 2 and not engine.scheduler.waiting


def test_a_request_queued_before_the_step_but_left_out_of_it_interjects(tiny_llama_path):
    """b's request is queued just before a step that a's prefill fills (b is a little ahead
    of a, so a goes first; no cap leaves room for it); it interjects at the step's first
    layer boundary instead of waiting for its end."""
    engine = make_engine(tiny_llama_path, long_prefill_token_threshold=0)
    engine.arrivals = arrivals = Scripted()
    engine.add_request("a", LONG, params(6), tenant="a")
    engine.step()  # a's first 32 tokens: a's counter is 32
    engine.scheduler.share.counters["b"] = 40.0
    engine.add_request("b", SHORT, params(5), tenant="b")
    engine.step()
    assert [(o.request_id, len(o.token_ids)) for o in arrivals.published] == [("b", 1)]
    assert engine.num_interjections == 1
