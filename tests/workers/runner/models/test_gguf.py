"""GGUF files of every family transformers can read, served by the engine: a tiny random model
written as llama.cpp lays one out (`gguf_files.py`), converted by `workers/model_files.py`
(its header read by `workers/gguf_metadata.py`) through transformers, served greedy in float32
on the CPU.

Each generated token must be the argmax of transformers' own model read from the same file, and
of the original random model the file was written from (the round trip is faithful). What no
family serves once read, and what transformers would read wrongly (a Mixtral), is refused
before the conversion, naming the architecture."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest

from tests.workers.runner.models.families import WINDOWED, assert_greedy_like_hf, build_family
from tests.workers.runner.models.gguf_files import llama3_rope_divisors, write_gguf
from workers import LLM, SamplingParams
from workers.gguf_metadata import gguf_config_overrides, read_gguf_header
from workers.runner.models import UnsupportedModelError

CPU32 = {"device": "cpu", "dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
VOCAB = 1024  # SmolLM2's first 1,024 tokens (see gguf_files.py)

# family -> its settings over `FAMILIES` for a model a GGUF describes whole: what llama.cpp's
# metadata cannot state is left at the value transformers' reader assumes
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 2048, "rope_theta": 10000.0}
ROUND_TRIP: dict[str, dict[str, Any]] = {
    # llama3 RoPE scaling: a tensor in the file, which transformers' reader drops and the
    # conversion turns back into settings; 8 frequencies of head_dim 16, 2 between its bounds
    "llama": dict(rope_parameters=LLAMA3),
    "mistral": {},  # written as arch `llama`, as llama.cpp writes it: served as a Llama
    "qwen2": {},
    "qwen3": {},  # head_dim 32, where Qwen3Config's default is 128
    # query_pre_attn_scalar is not in a GGUF (256 assumed); the window, attention and final
    # soft-capping are
    "gemma2": dict(query_pre_attn_scalar=256, **WINDOWED["gemma2"]),
    # layers 1-5 local, 6 global: llama.cpp's fixed pattern; linear scaling on the global layer
    "gemma3": dict(query_pre_attn_scalar=256, num_hidden_layers=6, layer_types=None,
                   **WINDOWED["gemma3"]),
    "phi3": dict(sliding_window=16),  # a window transformers' reader drops
    # llama.cpp's qwen3moe: every layer MoE, top-k weights renormalised; experts of width 48
    # where Qwen3MoeConfig's default is 768
    "qwen3_moe": dict(norm_topk_prob=True, mlp_only_layers=[]),
}
SERVED_AS = {"mistral": "llama"}  # the family serving what transformers reads


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(count)]


def hf_from_gguf(path: Path) -> Any:
    """transformers' model of the file, given the settings its reader drops (none for most)."""
    from transformers import AutoModelForCausalLM

    overrides = gguf_config_overrides(read_gguf_header(path))
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype="float32", **overrides).eval()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SWITCHBOARD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("family", list(ROUND_TRIP))
def test_gguf_family_is_served_like_transformers_and_the_original(tmp_path, tokenizer, cache,
                                                                  family):
    original = build_family(tmp_path / "hf", tokenizer, family, vocab_size=VOCAB,
                            **ROUND_TRIP[family])
    path = write_gguf(tmp_path / f"tiny-{family}.gguf", original, tokenizer, family)
    llm = LLM(str(path), kv_cache_memory=4 << 20, max_num_batched_tokens=32, block_size=16,
              **CPU32)
    assert llm.engine.runner.model.arch.family == SERVED_AS.get(family, family)
    batch = prompts(4, seed=len(family))
    outputs = [o.token_ids for o in llm.generate(batch, GREEDY)]
    assert_greedy_like_hf(hf_from_gguf(path), batch, outputs)
    assert_greedy_like_hf(original, batch, outputs)


def test_gguf_settings_transformers_drops_reach_the_served_config(tmp_path, tokenizer, cache):
    """Gemma 2's soft-capping (the file's 5 and 3, not Gemma2Config's 50 and 30), Qwen3's
    head_dim, Llama 3's RoPE scaling and Phi-3's window are in the converted folder's
    config.json, which other tools read too."""
    import json

    for family in ("gemma2", "qwen3", "llama", "phi3"):
        original = build_family(tmp_path / family, tokenizer, family, vocab_size=VOCAB,
                                **ROUND_TRIP[family])
        path = write_gguf(tmp_path / f"{family}.gguf", original, tokenizer, family)
        LLM(str(path), kv_cache_memory=4 << 20, **CPU32)
    configs = {p.name.split("-")[0]: json.loads((p / "config.json").read_text())
               for p in (cache / "models").iterdir()}
    gemma2 = configs["gemma2"]
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (5.0, 3.0)
    assert gemma2["sliding_window"] == 16
    assert configs["qwen3"]["head_dim"] == 32
    rope = configs["llama"]["rope_parameters"]
    assert rope == {**LLAMA3, "factor": pytest.approx(8.0), "high_freq_factor": pytest.approx(
        4.0, rel=1e-4)}
    assert configs["phi3"]["sliding_window"] == 16


def test_llama3_rope_tensor_that_fits_no_settings_is_warned_about(tmp_path, tokenizer, cache,
                                                                  caplog):
    """The llama family's test config (theta 500000, original length 64): one frequency of
    eight falls between the bounds, too few to tell them; the conversion says so and serves
    what transformers serves (unscaled RoPE)."""
    original = build_family(tmp_path / "hf", tokenizer, "llama", vocab_size=VOCAB)
    path = write_gguf(tmp_path / "llama3.gguf", original, tokenizer, "llama")
    header = read_gguf_header(path)
    assert "rope_freqs.weight" in header.tensors
    assert "rope_parameters" not in gguf_config_overrides(header)
    with caplog.at_level(logging.WARNING, logger="workers.gguf_metadata"):
        llm = LLM(str(path), kv_cache_memory=4 << 20, **CPU32)
    assert any("rope_freqs.weight" in r.getMessage() and "unscaled RoPE" in r.getMessage()
               for r in caplog.records)
    batch = prompts(3, seed=7)
    assert_greedy_like_hf(hf_from_gguf(path), batch,
                          [o.token_ids for o in llm.generate(batch, GREEDY)])


@pytest.mark.parametrize(("head_dim", "rope"), [
    (128, {"factor": 8.0, "original_max_position_embeddings": 8192}),  # Llama 3.1 8B / 70B
    (64, {"factor": 32.0, "original_max_position_embeddings": 8192}),  # Llama 3.2 1B
    (128, {"factor": 32.0, "original_max_position_embeddings": 8192}),  # Llama 3.2 3B
], ids=["llama3.1", "llama3.2-1b", "llama3.2-3b"])
def test_llama3_rope_settings_come_back_from_real_shapes(tmp_path, head_dim, rope):
    """`rope_freqs` as llama.cpp writes it for the Llama 3.x shapes gives their settings."""
    import gguf
    from transformers import LlamaConfig

    settings = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "rope_theta": 500000.0, **rope}
    config = LlamaConfig(hidden_size=32 * head_dim, num_attention_heads=32,
                         rope_parameters=settings)
    path = tmp_path / "rope.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_rope_freq_base(500000.0)
    writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = gguf_config_overrides(read_gguf_header(path))["rope_parameters"]
    assert found == {**settings, "factor": pytest.approx(rope["factor"], rel=1e-6),
                     "high_freq_factor": pytest.approx(4.0, rel=1e-4)}


def test_phi3_longrope_gguf_is_served_up_to_its_original_length(tmp_path, tokenizer, cache):
    """LongRoPE's factors are tensors in the file, which transformers' reader drops: they are
    turned back into settings, and the engine serves its short-factor regime as from HF."""
    factors = [1.0 + 0.25 * i for i in range(8)]
    rope = {"rope_type": "longrope", "short_factor": factors, "rope_theta": 10000.0,
            "long_factor": [f * 3 for f in factors], "original_max_position_embeddings": 64}
    original = build_family(tmp_path / "hf", tokenizer, "phi3", vocab_size=VOCAB,
                            rope_parameters=rope, original_max_position_embeddings=64)
    path = write_gguf(tmp_path / "phi3-long.gguf", original, tokenizer, "phi3")
    llm = LLM(str(path), kv_cache_memory=4 << 20, **CPU32)
    assert llm.engine.runner.max_model_len == 64
    batch = prompts(3, seed=9)
    outputs = [o.token_ids for o in llm.generate(batch, GREEDY)]
    assert_greedy_like_hf(hf_from_gguf(path), batch, outputs)
    assert_greedy_like_hf(original, batch, outputs)


def test_phi3_partial_rotary_gguf_is_read_whole_then_refused_by_name(tmp_path, tokenizer,
                                                                     cache):
    """Phi-4-mini rotates part of each head (`rope.dimension_count` < head_dim), which
    transformers' reader drops: the conversion keeps it, so the engine refuses the model by
    that setting instead of serving a fully rotated one."""
    import torch

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    original = build_family(tmp_path / "hf", tokenizer, "phi3", vocab_size=VOCAB,
                            rope_parameters=rope)
    path = write_gguf(tmp_path / "phi4-mini-like.gguf", original, tokenizer, "phi3")
    ids = torch.tensor(prompts(1, seed=11))
    with torch.no_grad():
        torch.testing.assert_close(hf_from_gguf(path)(ids).logits, original(ids).logits,
                                   rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.5\) is not supported"):
        LLM(str(path), kv_cache_memory=4 << 20, **CPU32)


@pytest.fixture
def no_conversion(monkeypatch) -> None:
    import transformers

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("transformers was asked to read the file")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_mixtral_gguf_is_refused_before_conversion(tmp_path, tokenizer, cache, no_conversion):
    """llama.cpp writes a Mixtral as arch `llama` with experts; transformers reads that as a
    dense Llama whose MLPs are missing (randomly initialised): refused, naming it."""
    original = build_family(tmp_path / "hf", tokenizer, "mixtral", vocab_size=VOCAB)
    path = write_gguf(tmp_path / "tiny-mixtral.gguf", original, tokenizer, "mixtral")
    header = read_gguf_header(path)
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["llama.expert_count"] == 8
    assert "blk.0.ffn_gate_exps.weight" in header.tensors
    with pytest.raises(UnsupportedModelError, match=r"architecture 'llama' with 8 experts "
                       r"\(a Mixtral\) is not served from GGUF.*MixtralForCausalLM"):
        LLM(str(path), kv_cache_memory=4 << 20, **CPU32)
    assert not cache.exists()


@pytest.mark.parametrize("arch", [
    "qwen2moe",  # transformers reads it; no family serves Qwen2MoeForCausalLM
    "falcon",  # the same
    "mistral3",  # transformers cannot read it
    "deepseek2",  # the same
    "gpt-oss",  # transformers reads it; its MXFP4 experts from GGUF are not checked here
])
def test_unserved_gguf_architecture_is_refused_before_conversion(tmp_path, tokenizer, cache,
                                                                 no_conversion, arch):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError) as refused:
        LLM(str(path), kv_cache_memory=4 << 20, **CPU32)
    message = str(refused.value)
    assert f"GGUF architecture {arch!r} is not served" in message
    assert "gemma3, llama, phi3, qwen2, qwen3, qwen3moe" in message  # what is
    assert not cache.exists()


def test_gguf_header_is_read_without_its_tensors(tmp_path, tokenizer):
    original = build_family(tmp_path / "hf", tokenizer, "qwen3_moe", vocab_size=VOCAB,
                            **ROUND_TRIP["qwen3_moe"])
    path = write_gguf(tmp_path / "m.gguf", original, tokenizer, "qwen3_moe")
    header = read_gguf_header(path)
    metadata = header.metadata
    assert metadata["general.architecture"] == "qwen3moe"
    assert metadata["qwen3moe.attention.key_length"] == 32
    assert metadata["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert metadata["tokenizer.ggml.tokens"] == VOCAB  # an array: its length
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert gguf_config_overrides(header) == {"moe_intermediate_size": 48}
    assert next(iter(header.tensors)) == "token_embd.weight"
    assert header.tensors["blk.2.ffn_down_exps.weight"][1] == (48, 64, 8)  # ggml's order
    norm = original.state_dict()["model.layers.1.self_attn.q_norm.weight"].tolist()
    assert header.f32("blk.1.attn_q_norm.weight") == pytest.approx(norm)  # data found
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"truncated\.gguf"):
        read_gguf_header(truncated)
