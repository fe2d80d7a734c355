"""Phi-3: Llama whose checkpoint stores q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (read as they are; LoRA adapts those fused modules, as peft names them);
a sliding window on every layer where the config sets one. LongRoPE is served in its
short-context regime only: up to `original_max_position_embeddings`, where HF uses the short
factors throughout; past it HF switches every position to the long factors mid-sequence."""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.runner.models.layers import Arch, uniform_window
from workers.runner.rope import rope_parameters


def arch(config: Any) -> Arch:
    base = Arch.of("phi3", config)
    limit = None
    params = rope_parameters(config)
    if params["rope_type"] == "longrope":
        limit = int(params.get("original_max_position_embeddings")
                    or config.original_max_position_embeddings)
    return dataclasses.replace(base, qkv_bias=False, o_bias=False, mlp_bias=False,
                               fused_checkpoint=True, max_model_len=limit,
                               windows=uniform_window(config))
