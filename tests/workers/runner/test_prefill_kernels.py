"""The CPU prefill kernels through the whole engine: each gives HF's greedy tokens where
chunks attend to cached context (a small step budget, prefix-cache hits)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import build_tiny_llama
from tests.workers.hf_reference import hf_greedy, hf_model
from workers import LLM, SamplingParams
from workers.runner import cpu_amx, vec_prefill

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


def heads64(tmp_path, tokenizer):
    """A random Llama with heads of 64, the size the C prefill kernels take."""
    return build_tiny_llama(tmp_path / "heads64", tokenizer, hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def cached_prompts(seed: int, shared_len: int, count: int, most: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40000) for _ in range(shared_len)]
    return [shared + [rng.randrange(100, 40000) for _ in range(rng.randint(5, most))]
            for _ in range(count)]


@pytest.mark.skipif(not vec_prefill.fits(torch.float32, 64, torch.device("cpu")),
                    reason="this CPU has neither AVX-512 nor AVX2")
def test_vec_prefill_float32_gives_hf_greedy_tokens(tmp_path, tokenizer):
    """Whole prompts and chunks after cached context (a 64-token step budget over 150 shared
    tokens) give HF's greedy tokens; `auto` picks `vec` for float32 heads of 64 on AVX-512."""
    path = heads64(tmp_path, tokenizer)
    prompts = cached_prompts(5, 150, 4, 90)
    model = hf_model(path)
    expected = [hf_greedy(model, p, MAX_NEW, eos=False) for p in prompts]
    auto = LLM(str(path), device="cpu", kv_cache_memory=16 << 20)
    preferred = vec_prefill.preferred(torch.float32, 64, torch.device("cpu"))
    assert auto.engine.runner.prefill_attention == ("vec" if preferred else "flash")
    llm = LLM(str(path), device="cpu", kv_cache_memory=16 << 20, max_num_batched_tokens=64,
              prefill_attention="vec")
    assert llm.engine.runner.prefill_attention == "vec"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens >= 144 for o in rest)


def _bf16_kernel_runs(kernel: str) -> bool:
    if kernel == "amx":
        return cpu_amx.available()
    return vec_prefill.fits(torch.bfloat16, 64, torch.device("cpu"))


@pytest.mark.parametrize("kernel", ["amx", "vec"])
def test_bfloat16_kernel_is_as_close_to_float32_as_the_flash_split(tmp_path, tokenizer, kernel):
    """Heads of 64, bfloat16, chunks after cached context: while greedy tokens agree with the
    float32 engine's, the kernel's logprobs are as close to float32's as those of the
    bfloat16 engine on the flash split (on this peaked random model either is up to about
    0.5 off; a near-tie forks the sequences after some tokens, so only the agreeing prefix is
    compared). `auto` picks `amx` where AMX runs, else `vec` where AVX-512 BF16 does."""
    if not _bf16_kernel_runs(kernel):
        pytest.skip(f"the {kernel} bfloat16 kernel does not run on this CPU")
    path = heads64(tmp_path, tokenizer)
    # the AMX case as first measured; the vector kernel's greedy tokens fork from float32's
    # sooner on its first four prompts (6 agreeing tokens), so it gets more to compare
    count, tokens = (4, 8) if kernel == "amx" else (6, 12)
    prompts = cached_prompts(3, 150, count, 90)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    outs = {}
    for name, dtype, asked in (("float32", "float32", "flash"), ("flash", "bfloat16", "flash"),
                               (kernel, "bfloat16", kernel)):
        llm = LLM(str(path), device="cpu", dtype=dtype, kv_cache_memory=16 << 20,
                  max_num_batched_tokens=64, prefill_attention=asked)
        assert llm.engine.runner.prefill_attention == asked
        first = llm.generate(prompts[:1], params)
        rest = llm.generate(prompts[1:], params)
        assert all(o.num_cached_tokens >= 144 for o in rest)
        outs[name] = [o.outputs[0] for o in first + rest]
    auto = LLM(str(path), device="cpu", dtype="bfloat16", kv_cache_memory=16 << 20)
    assert auto.engine.runner.prefill_attention == ("amx" if cpu_amx.available() else "vec")

    def deviations(name: str) -> list[float]:
        devs = []
        for got, want in zip(outs[name], outs["float32"], strict=True):
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                if a.token_id != b.token_id:
                    break
                devs.append(abs(a.logprob - b.logprob))
        return devs

    ours, flash = deviations(kernel), deviations("flash")
    assert len(ours) >= 8
    assert max(ours) <= max(flash) + 0.1
    assert sum(ours) / len(ours) <= sum(flash) / len(flash) + 0.05
