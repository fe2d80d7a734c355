"""Copy a HF Llama safetensors checkpoint into our model, fusing q/k/v and gate/up."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from workers.runner.model import LlamaModel

# checkpoint suffix -> (our parameter suffix, index of the shard inside the fused weight)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def load_weights(model: LlamaModel, folder: Path) -> None:
    """Fill every parameter of `model`; raise if the checkpoint misses or adds any."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a dict
                target = _target(name, model)
                if target is None:
                    continue
                param_name, offset, size = target
                tensor = reader.get_tensor(name)
                param = params[param_name]
                with torch.no_grad():
                    if size is None:
                        param.copy_(tensor)
                    else:
                        param.narrow(0, offset, size).copy_(tensor)
                filled.add(f"{param_name}:{offset}")
    expected = {f"{n}:{o}" for n, o in _expected_slots(model)}
    missing = expected - filled
    if missing:
        raise ValueError(f"checkpoint {folder} lacks weights: {sorted(missing)[:5]}")


def _target(name: str, model: LlamaModel) -> tuple[str, int, int | None] | None:
    """Our parameter, row offset and row count for one checkpoint tensor name."""
    name = name.removeprefix("model.")
    if name == "lm_head.weight":
        # Tied: either name may be the one a checkpoint kept (safetensors dedups them).
        return ("embed_tokens.weight" if model.tie_word_embeddings else name), 0, None
    if "rotary_emb" in name:
        return None
    for source, (fused, index) in _FUSED.items():
        marker = f".{source}."
        if marker in name:
            prefix, kind = name.split(marker)
            layer = model.layers[int(prefix.split(".")[1])]
            sizes = _shard_sizes(layer, fused)
            param = f"{prefix}.{fused}.{kind}"
            return param, sum(sizes[:index]), sizes[index]
    return name, 0, None


def _shard_sizes(layer: torch.nn.Module, fused: str) -> list[int]:
    if fused == "self_attn.qkv_proj":
        attn = layer.self_attn
        return [attn.q_size, attn.kv_size, attn.kv_size]
    return [layer.mlp.intermediate, layer.mlp.intermediate]


def _expected_slots(model: LlamaModel) -> list[tuple[str, int]]:
    slots = []
    for name, _ in model.named_parameters():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            layer = model.layers[int(name.split(".")[1])]
            sizes = _shard_sizes(layer, "self_attn.qkv_proj")
            slots += [(name, 0), (name, sizes[0]), (name, sizes[0] + sizes[1])]
        elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
            layer = model.layers[int(name.split(".")[1])]
            slots += [(name, 0), (name, layer.mlp.intermediate)]
        else:
            slots.append((name, 0))
    return slots
