"""The registry and the weight loader: what is not served is refused before anything loads;
a checkpoint's tensors are taken by name, and what is missing, extra or misshapen is named;
sharded folders load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.runner.models.families import (
    assert_greedy_like_hf,
    build_family,
    random_prompts,
)
from workers import LLM, SamplingParams
from workers.runner.models import (
    UnsupportedModelError,
    check_model_folder,
    family_of,
    served_architectures,
)
from workers.runner.models import weights as weights_module

CPU32 = {"device": "cpu", "dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory, tokenizer) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("qwen3")
    return folder, build_family(folder, tokenizer, "qwen3")


def copy_folder(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def test_family_from_architectures_then_model_type():
    assert family_of({"architectures": ["Qwen3ForCausalLM"]}).name == "qwen3"
    assert family_of({"architectures": ["Foo", "Gemma2ForCausalLM"]}).name == "gemma2"
    assert family_of({"model_type": "gemma3_text"}).name == "gemma3"
    # a served model_type under an architecture no family serves is still refused
    with pytest.raises(UnsupportedModelError, match="Gemma3ForConditionalGeneration"):
        family_of({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"} <= set(
                served_architectures())


def test_unknown_architecture_is_refused_before_any_weight_is_read(
        tmp_path, qwen3_folder, monkeypatch):
    folder = copy_folder(qwen3_folder[0], tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["FalconMambaForCausalLM"], model_type="falcon_mamba")
    (folder / "config.json").write_text(json.dumps(config))
    opened: list[str] = []
    monkeypatch.setattr(weights_module, "safe_open",
                        lambda path, **kw: opened.append(path) or pytest.fail("weights read"))
    with pytest.raises(UnsupportedModelError) as refused:
        LLM(str(folder), kv_cache_memory=4 << 20, **CPU32)
    message = str(refused.value)
    assert "FalconMambaForCausalLM" in message and "is not served" in message
    assert "Qwen3ForCausalLM" in message and "Gemma2ForCausalLM" in message  # the served list
    assert opened == []
    with pytest.raises(UnsupportedModelError):
        check_model_folder(folder)


def test_cli_refuses_an_unserved_model_folder_at_startup(tmp_path, capsys):
    from gateway.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    with pytest.raises(SystemExit) as done:
        main(["worker", "--model", str(tmp_path)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "BertForMaskedLM" in err and "is not served" in err and "LlamaForCausalLM" in err


def rewrite_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"),
     r"lacks weights: 'model\.layers\.1\.self_attn\.k_norm\.weight'"),
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight"),
     r"lacks weights: 'model\.layers\.0\.mlp\.up_proj\.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
     r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}),
     r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"),
    (lambda t: t.update({"model.norm.weight": torch.ones(65)}),
     r"tensor 'model\.norm\.weight' has shape \(65,\), the model expects \(64,\)"),
], ids=["missing", "missing-fused-part", "unexpected", "unexpected-bias", "shape"])
def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path, qwen3_folder, edit,
                                                            message):
    folder = copy_folder(qwen3_folder[0], tmp_path / "m")
    rewrite_weights(folder, edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), kv_cache_memory=4 << 20, **CPU32)


def test_sharded_folder_loads_from_its_index(tmp_path, tokenizer):
    """Several shards and their index; a stray checkpoint in another layout beside them
    (as Mistral's repos keep `consolidated.safetensors`) is not read."""
    hf = build_family(tmp_path / "one", tokenizer, "gemma2")
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="1MB")
    tokenizer.save_pretrained(folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (folder / "model.safetensors.index.json").is_file()
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)},
              folder / "consolidated.safetensors")
    llm = LLM(str(folder), kv_cache_memory=4 << 20, **CPU32)
    prompts = random_prompts(3, seed=4)
    assert_greedy_like_hf(hf, prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)])


def test_a_shard_the_index_lists_must_exist(tmp_path, qwen3_folder):
    folder = copy_folder(qwen3_folder[0], tmp_path / "m")
    names = list(load_file(folder / "model.safetensors"))
    index = {"weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        LLM(str(folder), kv_cache_memory=4 << 20, **CPU32)


def test_a_tied_config_whose_checkpoint_keeps_its_own_head_is_served_untied(
        tmp_path, tokenizer):
    # transformers unties them then (it warns), and so does vLLM: the engine must give the
    # tokens they give, not the embedding's
    folder = tmp_path / "m"
    build_family(folder, tokenizer, "qwen3", tie_word_embeddings=True)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"]

    def own_head(tensors: dict[str, torch.Tensor]) -> None:
        embedding = tensors["model.embed_tokens.weight"]
        tensors["lm_head.weight"] = torch.randn_like(embedding) * embedding.std()

    rewrite_weights(folder, own_head)
    assert weights_module.head_differs_from_embedding(folder)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    llm = LLM(str(folder), kv_cache_memory=4 << 20, **CPU32)
    prompts = random_prompts(3, seed=4)
    outputs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert_greedy_like_hf(hf, prompts, outputs)
    # an equal copy of the embedding under the head's name is still one tied matrix
    rewrite_weights(folder, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert not weights_module.head_differs_from_embedding(folder)
