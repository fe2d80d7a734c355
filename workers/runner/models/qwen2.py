"""Qwen2 / 2.5: Llama with biases on q, k and v (not on o); sliding windows, where the config
turns them on, on the layers from `max_window_layers` up (its `layer_types`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.runner.models.layers import Arch, layer_windows


def arch(config: Any) -> Arch:
    return dataclasses.replace(Arch.of("qwen2", config), qkv_bias=True, o_bias=False,
                               windows=layer_windows(config))
