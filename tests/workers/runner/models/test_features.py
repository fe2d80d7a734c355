"""Engine features on the other families: LoRA against peft (Qwen3 on its split projections,
Phi-3 on its fused ones), and int8 weights exact on int8-grid checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests.workers.lora.helpers import ALL_MODULES, make_peft_adapter, peft_model
from tests.workers.runner.models.families import (
    assert_greedy_like_hf,
    build_family,
    random_prompts,
)
from tests.workers.runner.test_quantization import on_int8_grid
from workers import LLM, SamplingParams
from workers.engine.structured import StructuredOutputs
from workers.lora.adapter import AdapterError

CPU32 = {"device": "cpu", "dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.mark.parametrize(("family", "targets"), [("qwen3", ALL_MODULES), ("phi3", PHI3_MODULES)])
def test_lora_equals_peft(tmp_path, tokenizer, family, targets):
    build_family(tmp_path / "base", tokenizer, family)
    adapter = make_peft_adapter(tmp_path / "base", tmp_path / "lora", seed=3, r=8,
                                target_modules=targets)
    reference = peft_model(tmp_path / "base", adapter)
    llm = LLM(str(tmp_path / "base"), kv_cache_memory=8 << 20, enable_lora=True,
              max_lora_rank=8, **CPU32)
    llm.add_lora("a", str(adapter))
    prompts = random_prompts(4, seed=5)
    mixed = llm.generate(prompts, GREEDY, lora=["a", None, "a", None])
    adapted = [o.token_ids for o in mixed[0::2]]
    assert_greedy_like_hf(reference, prompts[0::2], adapted)
    base = [o.token_ids for o in llm.generate(prompts[0::2], GREEDY)]
    assert adapted != base  # the adapter changes the output: the match above is its own


def test_phi3_refuses_split_projection_adapters_by_family(tmp_path, tokenizer):
    build_family(tmp_path / "phi3", tokenizer, "phi3")
    build_family(tmp_path / "llama", tokenizer, "llama", num_key_value_heads=4)
    adapter = make_peft_adapter(tmp_path / "llama", tmp_path / "lora", r=4,
                                target_modules=["q_proj", "v_proj"])
    llm = LLM(str(tmp_path / "phi3"), kv_cache_memory=4 << 20, enable_lora=True, **CPU32)
    with pytest.raises(AdapterError, match=r"unsupported target modules on phi3 models: "
                                           r"q_proj, v_proj \(supported: qkv_proj, o_proj"):
        llm.add_lora("a", str(adapter))


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3"])
def test_int8_weights_are_exact_on_grid_checkpoints(tmp_path, tokenizer, family):
    """Biases (Qwen2), a scaled tied embedding and soft-capped logits (Gemma 2), fused
    checkpoint projections (Phi-3): with float32 matmuls, int8 weights on the grid give the
    float model's tokens."""
    build_family(tmp_path / "base", tokenizer, family)
    grid = on_int8_grid(tmp_path / "base", tmp_path / "grid")
    prompts = random_prompts(3, seed=6)
    outs = []
    for quantization in ("none", "int8"):
        llm = LLM(str(grid), kv_cache_memory=4 << 20, quantization=quantization,
                  int8_compute="model", **CPU32)
        outs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
    assert outs[0] == outs[1]
    model = llm.engine.runner.model
    assert model.embed_tokens.qweight.dtype == torch.int8


def test_structured_output_on_another_family(tmp_path, tokenizer):
    """Grammars mask the vocabulary whatever the family (Gemma 2's soft-capped logits)."""
    build_family(tmp_path, tokenizer, "gemma2")
    llm = LLM(str(tmp_path), kv_cache_memory=4 << 20, **CPU32)
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured=StructuredOutputs(choice=["yes", "no"]))
    out = llm.generate([[100, 200, 300]], params)[0]
    assert out.text in ("yes", "no")
