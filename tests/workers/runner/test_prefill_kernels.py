"""The CPU prefill kernels through the whole engine: each gives HF's greedy tokens where
chunks attend to cached context (a small step budget, prefix-cache hits)."""

from __future__ import annotations

import random

import pytest

from tests.conftest import build_tiny_llama
from tests.workers.hf_reference import hf_greedy, hf_model
from workers import LLM, SamplingParams
from workers.runner import cpu_amx

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


@pytest.mark.skipif(not cpu_amx.available(),
                    reason="this CPU has no AMX bfloat16 (or Linux refused it)")
def test_amx_prefill_is_as_close_to_float32_as_the_flash_split(tmp_path, tokenizer):
    """Heads of 64 (the AMX kernel's size), bfloat16, chunks after cached context: `auto`
    picks `amx`, and while greedy tokens agree with the float32 engine's, their logprobs are
    as close to float32's as those of the bfloat16 engine on the flash split (on this peaked
    random model either is up to about 0.5 off; a near-tie forks the sequences after some
    tokens, so only the agreeing prefix is compared)."""
    path = build_tiny_llama(tmp_path / "heads64", tokenizer, hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    rng = random.Random(3)
    shared = [rng.randrange(100, 40000) for _ in range(150)]
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(rng.randint(5, 90))]
               for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = {}
    for name, dtype, kernel in (("float32", "float32", "auto"), ("flash", "bfloat16", "flash"),
                                ("amx", "bfloat16", "auto")):
        llm = LLM(str(path), device="cpu", dtype=dtype, kv_cache_memory=16 << 20,
                  max_num_batched_tokens=64, prefill_attention=kernel)
        assert llm.engine.runner.prefill_attention == ("flash" if name == "float32" else name)
        first = llm.generate(prompts[:1], params)
        rest = llm.generate(prompts[1:], params)
        assert all(o.num_cached_tokens >= 144 for o in rest)
        outs[name] = [o.outputs[0] for o in first + rest]

    def deviations(name: str) -> list[float]:
        devs = []
        for got, want in zip(outs[name], outs["float32"], strict=True):
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                if a.token_id != b.token_id:
                    break
                devs.append(abs(a.logprob - b.logprob))
        return devs

    amx, flash = deviations("amx"), deviations("flash")
    assert len(amx) >= 8
    assert max(amx) <= max(flash) + 0.1
    assert sum(amx) / len(amx) <= sum(flash) / len(flash) + 0.05
