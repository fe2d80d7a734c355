"""Mixtral: Mistral (a sliding window on every layer, or none) with experts in place of every
MLP: `num_local_experts` of `intermediate_size`, `num_experts_per_tok` per token, the top-k
softmax weights always renormalised and applied in float32; the checkpoint names the block
`block_sparse_moe` and each expert's gate/down/up `w1`/`w2`/`w3`."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from workers.runner.models.experts import MIXTRAL_NAMES, SparseMoE
from workers.runner.models.layers import Arch, uniform_window


def arch(config: Any) -> Arch:
    def mlp(arch: Arch, layer: int) -> nn.Module:
        return SparseMoE(arch, layer, num_experts=config.num_local_experts,
                         top_k=config.num_experts_per_tok, intermediate=arch.intermediate_size,
                         norm_topk_prob=True, names=MIXTRAL_NAMES, round_weights=False)

    return dataclasses.replace(Arch.of("mixtral", config), windows=uniform_window(config),
                               mlp=mlp, checkpoint_renames=(("block_sparse_moe.", "mlp."),))
