"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm per head) with experts in place of the MLP on
the layers `decoder_sparse_step` picks and `mlp_only_layers` does not (those keep a dense MLP of
`intermediate_size`): `num_experts` of `moe_intermediate_size`, `num_experts_per_tok` per
token, renormalised as `norm_topk_prob` says; a sliding window on every layer only where
`use_sliding_window` set one."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from workers.runner.models.experts import SparseMoE
from workers.runner.models.layers import MLP, Arch, uniform_window


def arch(config: Any) -> Arch:
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    experts = getattr(config, "num_experts", 0) or 0

    def mlp(arch: Arch, layer: int) -> nn.Module:
        if layer in dense or experts <= 0 or (layer + 1) % step:
            return MLP(arch, layer)
        return SparseMoE(arch, layer, num_experts=experts, top_k=config.num_experts_per_tok,
                         intermediate=config.moe_intermediate_size,
                         norm_topk_prob=bool(config.norm_topk_prob))

    return dataclasses.replace(Arch.of("qwen3_moe", config), qk_norm=True,
                               windows=uniform_window(config), mlp=mlp)
