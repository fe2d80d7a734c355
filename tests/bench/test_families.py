"""bench/families.py: one `family-<name>` model config per served family, all of one shape,
and random folders that keep each family's norms an identity (Gemma's (1 + w) ones at 0) and
tied embeddings tied. No engine runs here: the bench's own smoke run serves every folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench import families
from bench.common import model_folders
from workers.runner.models.registry import FAMILIES

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": 128,
        "max_position_embeddings": 256}


def test_every_served_family_has_a_config_of_the_common_shape():
    assert set(families.FAMILIES) == {f.name for f in FAMILIES}
    for family in FAMILIES:
        spec = model_folders.MODEL_CONFIGS[f"family-{family.name}"]
        assert spec["architecture"] in family.architectures
        for key, value in model_folders.FAMILY_SHAPE.items():
            # Mixtral's and gpt-oss's intermediate_size is their experts' size
            if key != "intermediate_size" or family.name not in ("mixtral", "gpt_oss"):
                assert spec[key] == value, (family.name, key)


def test_the_families_have_about_the_same_parameters():
    import transformers

    counts = {}
    for name, (architecture, _) in model_folders.FAMILY_FEATURES.items():
        settings = dict(model_folders.MODEL_CONFIGS[f"family-{name}"])
        settings.pop("architecture")
        cls = getattr(transformers, architecture)
        with torch.device("meta"):
            model = cls(cls.config_class(**settings))
        counts[name] = model.num_parameters()  # a tied matrix once
    llama = counts["llama"]
    assert all(abs(n - llama) / llama < 0.01 for n in counts.values()), counts


def tiny_folder(monkeypatch, tmp_path: Path, family: str) -> Path:
    architecture, features = model_folders.FAMILY_FEATURES[family]
    spec = {"architecture": architecture, **model_folders.FAMILY_SHAPE, **features, **TINY}
    if "layer_types" in spec:
        spec["layer_types"] = spec["layer_types"][: TINY["num_hidden_layers"]]
    if family in ("mixtral", "gpt_oss"):
        spec["intermediate_size"] = 32
    if family == "llama":
        spec["rope_parameters"] = {**spec["rope_parameters"],
                                   "original_max_position_embeddings": 64}
    monkeypatch.setitem(model_folders.MODEL_CONFIGS, f"tiny-{family}", spec)
    monkeypatch.setenv("SWITCHBOARD_CACHE_DIR", str(tmp_path / "cache"))
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}))
    return model_folders.build_random_model(f"tiny-{family}", base)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(("family", "identity"), [("gemma2", 0.0), ("gemma3", 0.0),
                                                  ("llama", 1.0), ("qwen3", 1.0)])
def test_norms_start_as_identities_and_the_head_stays_tied(monkeypatch, tmp_path, family,
                                                           identity):
    folder = tiny_folder(monkeypatch, tmp_path, family)
    saved = tensors(folder)
    norms = {k: t for k, t in saved.items() if k.endswith("norm.weight")}
    assert norms and all(bool((t == identity).all()) for t in norms.values())
    assert "lm_head.weight" not in saved
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True


def test_sizes_count_the_experts_one_token_uses(monkeypatch, tmp_path):
    folder = tiny_folder(monkeypatch, tmp_path, "mixtral")
    saved = tensors(folder)
    experts = sum(t.numel() for k, t in saved.items() if ".experts." in k)
    total = sum(t.numel() for t in saved.values())
    assert any(".block_sparse_moe.experts.7.w1." in k for k in saved)
    assert families.checkpoint_sizes(folder) == {"params": total,
                                                 "active_params": total - experts * 3 // 4}


def test_windows_are_read_as_the_engine_reads_them(monkeypatch, tmp_path):
    folder = tiny_folder(monkeypatch, tmp_path, "gemma2")
    assert families.windows_of(folder) == [4096, None]
    assert families.window_text([4096, None]) == "4096 x1/2"
    assert families.window_text([None, None]) == "-"


def test_machine_tags():
    assert families.machine_tag({"cpu": "AMD EPYC", "cpu_family_model": "family 26 model 2"}
                                ) == "zen5"
    assert families.machine_tag({"cpu": "AMD EPYC 9654", "cpu_family_model":
                                 "family 25 model 17"}) == "zen4"
    assert families.machine_tag({"cpu": "Intel(R) Xeon(R) Platinum 8581C CPU @ 2.30GHz",
                                 "cpu_family_model": "family 6 model 207"}) == "xeon207"
    assert families.machine_tag({"cpu": "x", "gpu": "NVIDIA H100 80GB HBM3"}) == "h100-80gb-hbm3"


def test_the_workload_flags_given_reach_engine_throughput(tmp_path):
    args = families.parse_args(["--families", "gemma2", "--num-requests", "4",
                                "--dtype", "bfloat16"])
    argv = families.engine_throughput_argv(args, "gemma2", tmp_path / "out.json")
    assert argv[argv.index("--model-config") + 1] == "family-gemma2"
    assert argv[argv.index("--num-requests") + 1] == "4"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert "--max-output" not in argv  # the standard workload's own
    with pytest.raises(SystemExit):
        families.parse_args(["--families", "gpt2"])
