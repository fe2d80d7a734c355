"""Rotary position embeddings, including the rope_scaling variants Llama checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """Read RoPE settings from a transformers 5 (`rope_parameters`) or 4 style config.

    `layer_type`: the settings of that kind of layer, for configs that keep one set per kind
    (Gemma 3: `sliding_attention` and `full_attention`, each with its own `rope_theta`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config: Any, head_dim: int, layer_type: str | None = None
                        ) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies and the attention scale the scaling type asks for."""
    params = rope_parameters(config, layer_type)
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("RoPE over part of each head (partial_rotary_factor "
                         f"{params['partial_rotary_factor']}) is not supported")
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq.float(), 1.0
    if rope_type == "linear":
        return (inv_freq / float(params["factor"])).float(), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params).float(), 1.0
    # yarn, longrope, dynamic and newer kinds: take transformers' own formulas.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
    return inv.float(), float(scale)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by factor, blend in between."""
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, blended, out)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_positions, applied by position id."""

    def __init__(self, config: Any, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scale = inverse_frequencies(config, head_dim, layer_type)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, computed once and shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate halves (HF's layout, not interleaved), in float32 for accuracy."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)
