"""Every served family on the real engine against HF's own forward: tiny random checkpoints
built from a config in code, served by `LLM` greedy in float32 on the CPU.

Each generated token must be HF's argmax given the tokens before it (near-ties within 1e-3
allowed), in one batch of mixed prompt lengths with chunked prefill, and a prefix-cache hit
must give the tokens of the miss."""

from __future__ import annotations

import pytest

from tests.workers.runner.models.families import (
    FAMILIES,
    WINDOWED,
    assert_greedy_like_hf,
    build_family,
    random_prompts,
)
from workers import LLM, SamplingParams

CPU32 = {"device": "cpu", "dtype": "float32"}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_hf(tmp_path, tokenizer, family):
    hf = build_family(tmp_path, tokenizer, family)
    # 32-token steps: the longer prompts prefill in chunks that read cached context
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, max_num_batched_tokens=32,
              block_size=16, **CPU32)
    assert llm.engine.runner.model.arch.family == family
    prompts = random_prompts(6, seed=1, lo=3, hi=70)
    first = [o.token_ids for o in llm.generate(prompts, greedy(12))]
    assert_greedy_like_hf(hf, prompts, first)
    again = llm.generate(prompts, greedy(12))  # the prompts' whole blocks are cached now
    assert [o.token_ids for o in again] == first
    assert all(o.num_cached_tokens >= len(p) // 16 * 16 - 16 for o, p in zip(
        again, prompts, strict=True))
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_window_family_matches_hf(tmp_path, tokenizer, family):
    """Prompts and outputs well past a 16-token window (8 for gpt-oss, with attention sinks;
    Gemma 2 with attention soft-capping too), prefilled whole and in chunks, decoded past the
    window."""
    hf = build_family(tmp_path, tokenizer, family, **WINDOWED[family])
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, max_num_batched_tokens=24,
              block_size=8, **CPU32)
    windows = [layer.self_attn.window for layer in llm.engine.runner.model.layers]
    assert WINDOWED[family]["sliding_window"] in windows
    prompts = random_prompts(5, seed=2, lo=5, hi=60)
    first = [o.token_ids for o in llm.generate(prompts, greedy(24))]
    assert_greedy_like_hf(hf, prompts, first)
    again = llm.generate(prompts, greedy(24))
    assert [o.token_ids for o in again] == first
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("family", ["gemma3", "phi3"])
def test_torch_paths_match_hf(tmp_path, tokenizer, family):
    """PyTorch's element-wise ops, SDPA decode groups and masked prefill (the CUDA fallbacks)
    for the per-head q/k norms, (1 + w) norms, GELU and a window (Gemma 3), and the fused
    checkpoint (Phi-3)."""
    hf = build_family(tmp_path, tokenizer, family, **WINDOWED.get(family, {}))
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, max_num_batched_tokens=24, block_size=8,
              elementwise="torch", attention_backend="torch", prefill_attention="masked",
              **CPU32)
    prompts = random_prompts(4, seed=3, lo=5, hi=50)
    assert_greedy_like_hf(hf, prompts, [o.token_ids for o in llm.generate(prompts, greedy(20))])


def test_phi3_longrope_is_served_up_to_its_original_length(tmp_path, tokenizer):
    """LongRoPE in its short-factor regime, where HF uses the short factors throughout: the
    default max_model_len stops at `original_max_position_embeddings`; past it is refused."""
    factors = [1.0 + 0.25 * i for i in range(8)]  # head_dim 16: 8 frequencies
    rope = {"rope_type": "longrope", "short_factor": factors, "rope_theta": 10000.0,
            "long_factor": [f * 3 for f in factors], "original_max_position_embeddings": 64}
    hf = build_family(tmp_path, tokenizer, "phi3", rope_parameters=rope,
                      original_max_position_embeddings=64)
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, **CPU32)
    assert llm.engine.runner.max_model_len == 64
    prompts = random_prompts(3, seed=5, lo=10, hi=40)
    assert_greedy_like_hf(hf, prompts, [o.token_ids for o in llm.generate(prompts, greedy(16))])
    with pytest.raises(ValueError, match="phi3: max_model_len 128 is past the 64 positions"):
        LLM(str(tmp_path), kv_cache_memory=8 << 20, max_model_len=128, **CPU32)
