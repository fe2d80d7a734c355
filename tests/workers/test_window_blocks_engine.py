"""The engine gives back blocks before a sliding window where every layer has one (Mistral)
and keeps HF's greedy tokens, with prefix-cache hits on blocks it gave back; a model with
global layers (Gemma 2) gives nothing back."""

from __future__ import annotations

import pytest

from tests.workers.runner.models.families import (
    WINDOWED,
    assert_greedy_like_hf,
    build_family,
    random_prompts,
)
from workers import LLM, SamplingParams
from workers.engine.block_manager import RELEASED, BlockManager


@pytest.mark.parametrize("attention", [("cpu", "flash"), ("torch", "masked")])
def test_mistral_gives_back_blocks_before_its_window_and_matches_hf(
        tmp_path, tokenizer, monkeypatch, attention):
    hf = build_family(tmp_path, tokenizer, "mistral", **WINDOWED["mistral"])  # window 16
    released = []
    release = BlockManager._release_before_window

    def counted(self, seq):
        release(self, seq)
        released.append(seq.block_table.count(RELEASED))

    monkeypatch.setattr(BlockManager, "_release_before_window", counted)
    backend, prefill = attention
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, max_num_batched_tokens=24, block_size=8,
              device="cpu", dtype="float32", attention_backend=backend,
              prefill_attention=prefill)
    bm = llm.engine.block_manager
    assert llm.engine.runner.kv_window == bm.window == 16
    prompts = random_prompts(4, seed=2, lo=30, hi=60)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    assert_greedy_like_hf(hf, prompts, first)
    assert max(released) >= 6  # 80 positions in: blocks 0-6 wholly before the window
    again = llm.generate(prompts, params)  # hits blocks named before they were given back
    assert [o.token_ids for o in again] == first
    assert all(o.num_cached_tokens >= 24 for o in again)
    assert bm.num_free_blocks == bm.num_blocks and set(bm.ref_counts) == {0}


def test_global_layers_keep_every_block(tmp_path, tokenizer):
    build_family(tmp_path, tokenizer, "gemma2", **WINDOWED["gemma2"])
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, block_size=8, device="cpu",
              dtype="float32")
    assert 16 in llm.engine.runner.model.windows
    assert llm.engine.runner.kv_window is None and llm.engine.block_manager.window is None
