"""Which family serves a checkpoint: `config.json`'s `architectures`, then its `model_type`.

A family is a module of this package with `arch(config)`: its differences from Llama as an
`Arch` (`layers.py`). This table is the one list of what is served; it imports no torch, so
`check_model_folder` can refuse a checkpoint from its config.json alone, before the
tokenizer, the weights or transformers' own config classes are touched (and the CLI can say so
before it starts anything).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.engine.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    from workers.runner.models.layers import Arch, DecoderModel


class UnsupportedModelError(InvalidRequestError):
    """A checkpoint of an architecture no family serves (a 400 where a request caused it)."""


@dataclass(frozen=True)
class Family:
    name: str  # its module under workers/runner/models/
    architectures: tuple[str, ...]  # config.json `architectures` it serves
    model_types: tuple[str, ...]  # `model_type`s it serves, for configs naming no architecture

    def arch(self, config: Any) -> Arch:
        return importlib.import_module(f"workers.runner.models.{self.name}").arch(config)


FAMILIES = (
    Family("llama", ("LlamaForCausalLM",), ("llama",)),
    Family("mistral", ("MistralForCausalLM",), ("mistral",)),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",)),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",)),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",)),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",)),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",)),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",)),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",)),
    Family("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",)),
)
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def served_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def family_of(config: Any) -> Family:
    """The family of a config (a transformers config, or config.json as a dict): the first of
    its `architectures` that one serves; `model_type` only where it names no architecture."""
    def get(key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    architectures = get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    model_type = get("model_type")
    for name in architectures:
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    if not architectures and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    named = ", ".join(map(str, architectures)) if architectures else f"model_type {model_type!r}"
    raise UnsupportedModelError(
        f"architecture {named} is not served by this engine (served: "
        f"{', '.join(served_architectures())})", param="model")


def check_model_folder(folder: str | Path) -> Family:
    """The family serving the checkpoint in `folder`, read from its config.json alone."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder}: no config.json") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return family_of(config)


def build_model(config: Any, max_positions: int, *, max_model_len: int | None = None
                ) -> DecoderModel:
    """The family's model for `config`, weights not loaded. `max_model_len`: the longest
    sequence it will serve (a sliding window at least that long is left out)."""
    from workers.runner.models.layers import DecoderModel

    return DecoderModel(config, max_positions, family_of(config).arch(config),
                        max_model_len=max_model_len)
