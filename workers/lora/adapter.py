"""Read a peft LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) and refuse,
with a clear message, anything the engine cannot serve exactly: DoRA, modules other than the
attention and MLP projections, ranks over the limit, a different base model, corrupt files,
config values of the wrong type or out of range, and non-finite numbers in the config or the
weights (one NaN would poison every row that uses the adapter).

The scaling (lora_alpha / r, or lora_alpha / sqrt(r) with rslora) is folded into B at load,
so applying an adapter is two matmuls per module and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from workers.engine.sampling_params import InvalidRequestError

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")
_REFUSED_FLAGS = {
    "use_dora": "DoRA adapters are not supported",
    "modules_to_save": "adapters with modules_to_save are not supported",
    "layers_to_transform": "adapters on some layers only (layers_to_transform) are not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style) adapters are not supported",
}
MAX_ALPHA = 1e6  # larger scalings are no fine-tune a base model survives


class AdapterError(InvalidRequestError):
    """An adapter the engine refuses to load (maps to HTTP 400)."""


@dataclass(frozen=True)
class ModuleShape:
    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    # (layer, module) -> (A [rank, in], B [out, rank] with the scaling folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def load_adapter(
    path: str | Path, *, name: str, max_rank: int, num_layers: int,
    shapes: dict[str, ModuleShape], dtype: torch.dtype = torch.float32,
    family: str | None = None,
) -> LoRAAdapter:
    """Validate and load; `shapes` are the base model's projection shapes by peft module name
    (the base check), and name the modules an adapter may target (`SUPPORTED_MODULES` on
    Llama-like families; Phi-3's fused `qkv_proj` and `gate_up_proj` instead of their parts).
    `family` names the base model's family in refusals."""
    folder = Path(path)
    config = _read_config(folder)
    rank = _rank(config, max_rank)
    targets = _targets(config, tuple(shapes) or SUPPORTED_MODULES, family)
    scale = _alpha(config, rank) / (math.sqrt(rank) if _flag(config, "use_rslora") else rank)
    tensors = _read_weights(folder)
    weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: unexpected tensor {key!r}")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in targets:
            raise AdapterError(f"adapter {name!r}: tensor for {module} not in target_modules")
        if layer >= num_layers:
            raise AdapterError(f"adapter {name!r} has layer {layer}, the base model has "
                               f"{num_layers}: it was made for another base model")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"adapter {name!r}: {key} has non-finite values (NaN or inf)")
        weights.setdefault((layer, module), {})[side] = tensor
    loaded = {}
    for (layer, module), pair in weights.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        shape = shapes[module]
        if tuple(a.shape) != (rank, shape.in_features) or tuple(b.shape) != (
                shape.out_features, rank):
            raise AdapterError(
                f"adapter {name!r}: {module} has shapes A{tuple(a.shape)} B{tuple(b.shape)}, "
                f"expected A({rank}, {shape.in_features}) B({shape.out_features}, {rank}): it was "
                "made for another base model")
        loaded[(layer, module)] = (a.to(dtype).contiguous(), (b.to(torch.float32) * scale)
                                   .to(dtype).contiguous())
    if not loaded:
        raise AdapterError(f"adapter {name!r} has no LoRA weights")
    return LoRAAdapter(name, rank, scale, frozenset(targets), loaded)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"no adapter_config.json in {folder}") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterError(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError("adapter_config.json must be a JSON object")
    _check_finite(config, "adapter_config.json")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"only LoRA adapters are supported, not {config.get('peft_type')}")
    for flag, message in _REFUSED_FLAGS.items():
        if config.get(flag):
            raise AdapterError(message)
    if config.get("bias", "none") != "none":
        raise AdapterError("adapters that train biases are not supported")
    return config


def _rank(config: dict[str, Any], max_rank: int) -> int:
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError("adapter_config.json: 'r' must be a positive integer")
    if rank > max_rank:
        raise AdapterError(f"adapter rank {rank} exceeds max_lora_rank={max_rank}")
    return rank


def _alpha(config: dict[str, Any], rank: int) -> float:
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not (
            0 < alpha <= MAX_ALPHA):
        raise AdapterError(f"adapter_config.json: 'lora_alpha' must be a number above 0 and at "
                           f"most {MAX_ALPHA:g}")
    dropout = config.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not (
            0 <= dropout < 1):
        raise AdapterError("adapter_config.json: 'lora_dropout' must be a number in [0, 1)")
    return float(alpha)


def _flag(config: dict[str, Any], name: str) -> bool:
    value = config.get(name, False)
    if not isinstance(value, bool):
        raise AdapterError(f"adapter_config.json: '{name}' must be true or false")
    return value


def _check_finite(value: object, where: str) -> None:
    """JSON as Python reads it allows NaN and Infinity; no value of a config may be one."""
    if isinstance(value, float) and not math.isfinite(value):
        raise AdapterError(f"{where} has a non-finite number (NaN or Infinity)")
    if isinstance(value, dict):
        for item in value.values():
            _check_finite(item, where)
    elif isinstance(value, list):
        for item in value:
            _check_finite(item, where)


def _targets(config: dict[str, Any], supported: tuple[str, ...] = SUPPORTED_MODULES,
             family: str | None = None) -> set[str]:
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(
            isinstance(t, str) for t in targets):
        raise AdapterError("adapter_config.json: target_modules must be a list of module names")
    unsupported = sorted(set(targets) - set(supported))
    if unsupported:
        base = f" on {family} models" if family else ""
        raise AdapterError(f"unsupported target modules{base}: {', '.join(unsupported)} "
                           f"(supported: {', '.join(supported)})")
    return set(targets)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / "adapter_model.safetensors"
    try:
        return load_file(path)
    except FileNotFoundError:
        raise AdapterError(f"no adapter_model.safetensors in {folder}") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"adapter_model.safetensors is corrupt: {exc}") from None
