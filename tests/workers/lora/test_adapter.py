"""Loading peft adapters: the deltas equal peft's, and what cannot be served is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import build_tiny_llama
from tests.workers.lora.helpers import ALL_MODULES, make_peft_adapter
from workers.lora.adapter import AdapterError, ModuleShape, load_adapter

ALL = ALL_MODULES


def shapes_of(model) -> dict[str, ModuleShape]:
    layer = model.model.layers[0]
    modules = {**{n: getattr(layer.self_attn, n) for n in ALL[:4]},
               **{n: getattr(layer.mlp, n) for n in ALL[4:]}}
    return {n: ModuleShape(m.in_features, m.out_features) for n, m in modules.items()}


def make_adapter(base: Path, out: Path, **lora: object) -> Path:
    return make_peft_adapter(base, out, **lora)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    path = build_tiny_llama(tmp_path_factory.mktemp("lora-base"), tokenizer)
    return path, AutoModelForCausalLM.from_pretrained(path)


def load(path: Path, model, **kwargs):
    return load_adapter(path, name="a", max_rank=kwargs.pop("max_rank", 16),
                        num_layers=model.config.num_hidden_layers, shapes=shapes_of(model),
                        **kwargs)


@pytest.mark.parametrize("rslora", [False, True])
def test_deltas_equal_peft(base, tmp_path, rslora):
    path, model = base
    adapter_dir = make_adapter(path, tmp_path / "ad", use_rslora=rslora,
                               target_modules=["q_proj", "v_proj", "down_proj"])
    adapter = load(adapter_dir, model)
    assert adapter.target_modules == {"q_proj", "v_proj", "down_proj"}
    peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path),
                                                adapter_dir)
    torch.manual_seed(1)
    for (layer, module), (a, b) in adapter.weights.items():
        parent = peft_model.base_model.model.model.layers[layer]
        lora_layer = getattr(parent.self_attn if module.endswith(("q_proj", "v_proj")) else
                             parent.mlp, module)
        x = torch.randn(3, a.shape[1])
        expected = lora_layer(x) - lora_layer.base_layer(x)
        torch.testing.assert_close(x @ a.T @ b.T, expected, rtol=1e-4, atol=1e-5)
    assert adapter.scaling == (16 / 8 ** 0.5 if rslora else 2.0)


def test_refusals(base, tmp_path, tokenizer):
    path, model = base
    good = make_adapter(path, tmp_path / "good")

    def variant(name: str, **config_changes: object) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config.update(config_changes)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        return folder

    cases = {
        "DoRA": variant("dora", use_dora=True),
        "unsupported target": variant("emb", target_modules=["q_proj", "embed_tokens"]),
        "rank 8 exceeds": good,
    }
    for message, folder in cases.items():
        with pytest.raises(AdapterError, match=message):
            load(folder, model, max_rank=4 if message.startswith("rank") else 16)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="corrupt"):
        load(corrupt, model)
    (corrupt / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        load(corrupt, model)
    other_base = build_tiny_llama(tmp_path / "wide", tokenizer, hidden_size=96,
                                  intermediate_size=128)
    wrong = make_adapter(other_base, tmp_path / "wrong")
    with pytest.raises(AdapterError, match="another base model"):
        load(wrong, model)


@pytest.mark.parametrize(("changes", "message"), [
    ({"lora_alpha": "abc"}, "'lora_alpha' must be a number"),
    ({"lora_alpha": float("nan")}, "non-finite"),
    ({"lora_alpha": float("inf")}, "non-finite"),
    ({"lora_alpha": 0}, "'lora_alpha' must be a number above 0"),
    ({"lora_alpha": 1e9}, "at most"),
    ({"lora_alpha": True}, "'lora_alpha' must be a number"),
    ({"lora_dropout": 1.5}, "'lora_dropout'"),
    ({"use_rslora": "yes"}, "'use_rslora' must be true or false"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"task_type": {"nested": [1.0, float("-inf")]}}, "non-finite"),
])
def test_malformed_config_values_are_refused(base, tmp_path, changes, message):
    path, model = base
    folder = make_adapter(path, tmp_path / "bad")
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))  # NaN/Infinity as Python
    with pytest.raises(AdapterError, match=message):
        load(folder, model)


def test_non_finite_weights_are_refused(base, tmp_path):
    from safetensors.torch import load_file, save_file

    path, model = base
    folder = make_adapter(path, tmp_path / "nan")
    weights = load_file(folder / "adapter_model.safetensors")
    first = sorted(weights)[0]
    weights[first][0, 0] = float("nan")
    save_file(weights, folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="non-finite"):
        load(folder, model)
