"""Mistral: Llama with a sliding window on every layer (`sliding_window`, None for none; HF's
Mistral applies it to all layers whatever else the config lists)."""

from __future__ import annotations

import dataclasses
from typing import Any

from workers.runner.models.layers import Arch, uniform_window


def arch(config: Any) -> Arch:
    return dataclasses.replace(Arch.of("mistral", config), windows=uniform_window(config))
