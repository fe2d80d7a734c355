"""Gemma 3 (text only, `Gemma3ForCausalLM`): Gemma 2 plus RMSNorm (1 + w) over each head of q
and k, and a RoPE table per layer type: `sliding_attention` layers rotate with the local base
(`rope_local_base_freq`), `full_attention` ones with `rope_theta` and its scaling."""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.runner.models.gemma2 import gemma_arch
from workers.runner.models.layers import Arch


def arch(config: Any) -> Arch:
    types = tuple(config.layer_types)
    return dataclasses.replace(gemma_arch("gemma3", config), qk_norm=True, rope_keys=types,
                               ropes={t: t for t in sorted(set(types))})
