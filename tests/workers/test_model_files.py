"""Model resolution: a HF folder as is, a GGUF converted once into the cache."""

from __future__ import annotations

import json

import pytest
import torch

from workers.model_files import (
    CONVERSION_MARKER,
    CONVERSION_VERSION,
    convert_gguf,
    default_gguf,
    is_current,
    resolve_model,
    write_hf_folder,
)


def test_hf_folder_is_used_in_place(tiny_llama_path):
    assert resolve_model(tiny_llama_path) == tiny_llama_path
    assert resolve_model(str(tiny_llama_path)) == tiny_llama_path


def test_default_model_can_be_pointed_elsewhere(tiny_llama_path, monkeypatch):
    """Where the bundled package is absent (a GPU box), the default comes from the env."""
    monkeypatch.setenv("SWITCHBOARD_DEFAULT_MODEL", str(tiny_llama_path))
    assert resolve_model(None) == tiny_llama_path
    monkeypatch.setenv("SWITCHBOARD_DEFAULT_MODEL", "")
    assert resolve_model(None) != tiny_llama_path


def test_missing_or_wrong_paths_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        resolve_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        resolve_model(tmp_path)


@pytest.mark.slow
def test_default_gguf_converts_once_then_loads_from_cache(tmp_path, monkeypatch, smollm2_path):
    assert (smollm2_path / "model.safetensors").is_file()
    assert (smollm2_path / "chat_template.jinja").is_file() or "chat_template" in (
        smollm2_path / "tokenizer_config.json"
    ).read_text()
    config = (smollm2_path / "config.json").read_text()
    assert "quantization_config" not in config
    import transformers

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert convert_gguf(default_gguf()) == smollm2_path


def _tiny_gguf_like_model(tokenizer):
    """A tiny tied Llama in the state a GGUF load leaves it: no `architectures`, a
    `quantization_config`, the LM head and embedding one tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, initializer_range=0.2, rope_theta=50000.0)
    model = LlamaForCausalLM(config).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.config.architectures = None
    model.config.quantization_config = {"quant_method": "gguf"}
    return model


def _runner_logits(folder, token_ids: list[int]) -> torch.Tensor:
    """Every position's logits from our model runner over the paged pool (one prefill)."""
    from transformers import AutoConfig

    from workers.runner.attention import build_metadata
    from workers.runner.model_runner import ModelRunner, RunnerConfig

    cpu = torch.device("cpu")
    hf_config = AutoConfig.from_pretrained(folder)
    runner = ModelRunner.load(
        RunnerConfig(model_path=folder, device=cpu, dtype=torch.float32, block_size=16,
                     kv_cache_memory=8 << 20, kv_cache_fraction=None, max_model_len=None),
        hf_config, [0])
    n = len(token_ids)
    meta = build_metadata([(0, n, list(range(-(-n // 16))))], 16, runner.num_kv_heads,
                          runner.group, cpu)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(token_ids), torch.arange(n), runner.kv_caches, meta,
                              16)
        return runner.model.compute_logits(hidden)


def _hf_logits(folder, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0]


TOKENS = [1, 504, 3458, 314, 260, 3290, 30, 2, 17, 905]


def test_written_folder_is_standard_and_transformers_matches_our_runner(tmp_path, tokenizer):
    from safetensors import safe_open

    folder = tmp_path / "converted"
    folder.mkdir()
    write_hf_folder(_tiny_gguf_like_model(tokenizer), tokenizer, folder)

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    with safe_open(str(folder / "model.safetensors"), framework="pt") as reader:
        names = set(reader.keys())
        assert reader.metadata() == {"format": "pt"}
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names  # tied: HF stores the embedding only
    assert is_current(folder)

    ours, theirs = _runner_logits(folder, TOKENS), _hf_logits(folder, TOKENS)
    assert theirs.abs().max() > 1  # not a degenerate all-zero model
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_stale_conversion_is_redone_in_place_and_then_reused(tmp_path, monkeypatch, tokenizer):
    import transformers

    monkeypatch.setenv("SWITCHBOARD_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")  # never parsed: loading is stubbed below
    calls = []

    def fake_model(*args, **kwargs):
        calls.append(args)
        return _tiny_gguf_like_model(tokenizer)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *args, **kwargs: tokenizer)
    out = convert_gguf(gguf)
    # an older conversion: weights present, no marker, a file the new one does not write
    (out / CONVERSION_MARKER).unlink()
    (out / "leftover.txt").write_text("old")
    assert not is_current(out)

    assert convert_gguf(gguf) == out
    assert len(calls) == 2
    assert is_current(out) and not (out / "leftover.txt").exists()
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no tmp or stale copies left
    (out / CONVERSION_MARKER).write_text(json.dumps({"version": CONVERSION_VERSION - 1}))
    assert convert_gguf(gguf) == out and len(calls) == 3

    assert convert_gguf(gguf) == out and len(calls) == 3  # current: reused as is


@pytest.mark.slow
def test_default_folder_is_standard_and_transformers_matches_our_runner(smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    ours, theirs = _runner_logits(smollm2_path, TOKENS), _hf_logits(smollm2_path, TOKENS)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours[-1].argmax() == theirs[-1].argmax()
