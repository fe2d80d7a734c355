"""The shared decoder layers, under their former home (`workers/runner/models/layers.py`).
`LlamaModel(config, max_positions)` is the decoder with Llama's `Arch`."""

from workers.runner.models.layers import (
    MLP,
    Arch,
    Attention,
    DecoderLayer,
    DecoderModel,
    RMSNorm,
    Rope,
)

LlamaModel = DecoderModel

__all__ = ["MLP", "Arch", "Attention", "DecoderLayer", "DecoderModel", "LlamaModel", "RMSNorm",
           "Rope"]
