"""Qwen3: Llama with RMSNorm over each head of q and k before RoPE, and `head_dim` from the
config (not hidden / heads); biases as `attention_bias` says."""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.runner.models.layers import Arch, layer_windows


def arch(config: Any) -> Arch:
    return dataclasses.replace(Arch.of("qwen3", config), qk_norm=True,
                               windows=layer_windows(config))
