"""Llama 1-3.x: the base every other family is stated against (RoPE scaling in `rope.py`)."""

from __future__ import annotations

from typing import Any

from workers.runner.models.layers import Arch


def arch(config: Any) -> Arch:
    return Arch.of("llama", config)
