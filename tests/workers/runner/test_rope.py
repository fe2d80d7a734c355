"""Our RoPE frequencies against transformers' own, for each scaling type we implement."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from workers.runner.rope import inverse_frequencies, rope_parameters


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
         "original_max_position_embeddings": 2048},
    ],
    ids=lambda p: p["rope_type"],
)
def test_scaled_frequencies_match_transformers(params):
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=params,
                         max_position_embeddings=32768)
    ours, scale = inverse_frequencies(config, 64)
    theirs, their_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    torch.testing.assert_close(ours, theirs.float())
    assert scale == pytest.approx(their_scale)


def test_default_rope_and_legacy_config_fields():
    class Legacy:
        rope_theta = 1234.0
        rope_scaling = None

    assert rope_parameters(Legacy()) == {"rope_theta": 1234.0, "rope_type": "default"}
    inv, scale = inverse_frequencies(Legacy(), 8)
    expected = 1.0 / (1234.0 ** (torch.arange(0, 8, 2).float() / 8))
    torch.testing.assert_close(inv, expected)
    assert scale == 1.0
