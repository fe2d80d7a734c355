"""Gemma 2: embeddings scaled by sqrt(hidden); norms that scale by (1 + w), after attention
and after the MLP as well as before them; GELU-tanh in the gated MLP; attention scale
`query_pre_attn_scalar ** -0.5`; attention and final logit soft-capping; a sliding window on
alternate layers (`layer_types`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from workers.runner.models.layers import Arch, layer_windows


def gemma_arch(family: str, config: Any) -> Arch:
    """What Gemma 2 and 3 share."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{family}: bidirectional attention is not served")
    return dataclasses.replace(
        Arch.of(family, config),
        activation=config.hidden_activation,
        norm_offset=1.0,
        embed_scale=math.sqrt(config.hidden_size),
        sandwich_norms=True,
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_softcap=config.attn_logit_softcapping,
        final_softcap=config.final_logit_softcapping,
        windows=layer_windows(config),
    )


def arch(config: Any) -> Arch:
    return gemma_arch("gemma2", config)
