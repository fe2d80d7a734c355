"""The CPU prefill kernels through the whole engine: each gives HF's greedy tokens where
chunks attend to cached context (a small step budget, prefix-cache hits)."""

from __future__ import annotations

import random

import pytest

from tests.workers.hf_reference import hf_greedy, hf_model
from workers import LLM, SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_llama_path):
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(37)]  # a prefix the cache can hit
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))]
               for _ in range(6)]
    model = hf_model(tiny_llama_path)
    return prompts, [hf_greedy(model, p, MAX_NEW, eos=False) for p in prompts]


@pytest.mark.parametrize("kernel", ["flash", "masked"])
def test_chunks_after_cached_context_match_hf(tiny_llama_path, prompts_and_reference, kernel):
    prompts, expected = prompts_and_reference
    llm = LLM(str(tiny_llama_path), device="cpu", kv_cache_memory=8 << 20,
              max_num_batched_tokens=24, prefill_attention=kernel)
    assert llm.engine.runner.prefill_attention == kernel
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate(prompts[:1], params)  # warms the cache for the shared prefix
    rest = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens >= 32 for o in rest)


def test_auto_picks_the_flash_split_on_cpu(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), device="cpu", kv_cache_memory=8 << 20)
    assert llm.engine.runner.prefill_attention == "flash"
