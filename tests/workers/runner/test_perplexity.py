"""Perplexity through the runner equals HF's on a tiny Llama (any chunking, either attention
path); on the bundled SmolLM2 and the held-out text, int8 weights and an int8 KV cache each
stay within 1% of float32 perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.workers.hf_reference import hf_model
from workers import LLM
from workers.runner.perplexity import perplexity

HELD_OUT = Path(__file__).resolve().parents[2] / "data" / "heldout.txt"


@torch.inference_mode()
def hf_perplexity(path: Path, ids: list[int]) -> float:
    model = hf_model(path)
    out = model(torch.tensor([ids]), labels=torch.tensor([ids]))
    return math.exp(float(out.loss))


@pytest.mark.parametrize(("chunk", "backend"), [(32, "cpu"), (7, "torch"), (1, "cpu")])
def test_runner_perplexity_equals_hf(tiny_llama_path, tokenizer, chunk, backend):
    ids = tokenizer.encode(HELD_OUT.read_text())[:120]
    llm = LLM(str(tiny_llama_path), kv_cache_memory=4 << 20, attention_backend=backend)
    got = perplexity(llm.engine.runner, ids, chunk)
    assert got == pytest.approx(hf_perplexity(tiny_llama_path, ids), rel=1e-4)


def test_text_longer_than_the_pool_is_refused(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), kv_cache_memory=1 << 16, block_size=8)
    with pytest.raises(ValueError, match="does not fit"):
        perplexity(llm.engine.runner, [5] * (llm.engine.runner.num_blocks * 8 + 1))


@pytest.fixture(scope="module")
def smollm2_float_ppl() -> float:
    llm = LLM(None, kv_cache_memory=64 << 20)
    return perplexity(llm.engine.runner, llm.tokenizer.encode(HELD_OUT.read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    {"quantization": "int8"}, {"quantization": "int8", "int8_compute": "model"},
    {"kv_cache_dtype": "int8"}, {"quantization": "int8", "kv_cache_dtype": "int8"}],
    ids=["int8-weights", "int8-weights-float-matmul", "int8-kv", "both"])
def test_int8_perplexity_within_1_percent_of_float(smollm2_float_ppl, settings):
    llm = LLM(None, kv_cache_memory=64 << 20, **settings)
    got = perplexity(llm.engine.runner, llm.tokenizer.encode(HELD_OUT.read_text()))
    assert 5 < smollm2_float_ppl < 100  # a real model on English prose
    assert abs(got / smollm2_float_ppl - 1) < 0.01
