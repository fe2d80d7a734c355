"""Model resolution: a HF folder as is, a GGUF converted once into the cache."""

from __future__ import annotations

import pytest

from workers.model_files import convert_gguf, default_gguf, resolve_model


def test_hf_folder_is_used_in_place(tiny_llama_path):
    assert resolve_model(tiny_llama_path) == tiny_llama_path
    assert resolve_model(str(tiny_llama_path)) == tiny_llama_path


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
