"""GGUF files of every family transformers can read, served by the engine: a tiny random model
written as llama.cpp lays one out (`gguf_files.py`), converted by `workers/model_files.py`
through transformers, served greedy in float32 on the CPU.

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
from tests.workers.runner.models.gguf_files import write_gguf
from workers import LLM, SamplingParams
from workers.model_files import gguf_config_overrides, read_gguf_metadata
from workers.runner.models import UnsupportedModelError

CPU32 = {"device": "cpu", "dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
VOCAB = 1024  # SmolLM2's first 1,024 tokens (see gguf_files.py)

# family -> its settings over `FAMILIES` for a model a GGUF describes whole: what llama.cpp's
# metadata cannot state is left at the value transformers' reader assumes
ROUND_TRIP: dict[str, dict[str, Any]] = {
    # llama3 RoPE scaling is a tensor transformers drops (test below)
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "mistral": {},  # written as arch `llama`, as llama.cpp writes it: served as a Llama
    "qwen2": {},
    "qwen3": {},  # head_dim 32, where Qwen3Config's default is 128
    # query_pre_attn_scalar is not in a GGUF (256 assumed); the window, attention and final
    # soft-capping are
    "gemma2": dict(query_pre_attn_scalar=256, **WINDOWED["gemma2"]),
    # layers 1-5 local, 6 global: llama.cpp's fixed pattern; linear scaling on the global layer
    "gemma3": dict(query_pre_attn_scalar=256, num_hidden_layers=6, layer_types=None,
                   **WINDOWED["gemma3"]),
    "phi3": {},
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

    overrides = gguf_config_overrides(read_gguf_metadata(path)[0])
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
    """Gemma 2's soft-capping (the file's 5 and 3, not Gemma2Config's 50 and 30) and Qwen3's
    head_dim are in the converted folder's config.json, which other tools read too."""
    import json

    for family in ("gemma2", "qwen3"):
        original = build_family(tmp_path / family, tokenizer, family, vocab_size=VOCAB,
                                **ROUND_TRIP[family])
        path = write_gguf(tmp_path / f"{family}.gguf", original, tokenizer, family)
        LLM(str(path), kv_cache_memory=4 << 20, **CPU32)
    folders = {p.name.split("-")[0]: p for p in (cache / "models").iterdir()}
    gemma2 = json.loads((folders["gemma2"] / "config.json").read_text())
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (5.0, 3.0)
    assert gemma2["sliding_window"] == 16
    assert json.loads((folders["qwen3"] / "config.json").read_text())["head_dim"] == 32


def test_llama3_rope_tensor_is_dropped_with_a_warning(tmp_path, tokenizer, cache, caplog):
    """llama.cpp stores Llama 3's RoPE scaling as a `rope_freqs` tensor, which transformers'
    reader maps to nothing: the conversion says so, and serves what transformers serves."""
    original = build_family(tmp_path / "hf", tokenizer, "llama", vocab_size=VOCAB)
    path = write_gguf(tmp_path / "llama3.gguf", original, tokenizer, "llama")
    assert "rope_freqs.weight" in read_gguf_metadata(path)[1]
    with caplog.at_level(logging.WARNING, logger="workers.model_files"):
        llm = LLM(str(path), kv_cache_memory=4 << 20, **CPU32)
    assert any("rope_freqs.weight" in r.getMessage() and "unscaled RoPE" in r.getMessage()
               for r in caplog.records)
    batch = prompts(3, seed=7)
    assert_greedy_like_hf(hf_from_gguf(path), batch,
                          [o.token_ids for o in llm.generate(batch, GREEDY)])


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
    metadata, tensors = read_gguf_metadata(path)
    assert metadata["general.architecture"] == "llama" and metadata["llama.expert_count"] == 8
    assert "blk.0.ffn_gate_exps.weight" in tensors
    with pytest.raises(UnsupportedModelError, match=r"architecture 'llama' with 8 experts "
                       r"\(a Mixtral\) is not served from GGUF.*MixtralForCausalLM"):
        LLM(str(path), kv_cache_memory=4 << 20, **CPU32)
    assert not cache.exists()


@pytest.mark.parametrize("arch", [
    "qwen2moe",  # transformers reads it; no family serves Qwen2MoeForCausalLM
    "falcon",  # the same
    "mistral3",  # transformers cannot read it
    "deepseek2",  # the same
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
    metadata, tensors = read_gguf_metadata(path)
    assert metadata["general.architecture"] == "qwen3moe"
    assert metadata["qwen3moe.attention.key_length"] == 32
    assert metadata["qwen3moe.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert metadata["tokenizer.ggml.tokens"] == VOCAB  # an array: its length
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert gguf_config_overrides(metadata) == {"moe_intermediate_size": 48}
    assert tensors[0] == "token_embd.weight" and "blk.2.ffn_down_exps.weight" in tensors
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"truncated\.gguf"):
        read_gguf_metadata(truncated)
