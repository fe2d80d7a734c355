"""Shared fixtures: the bundled SmolLM2 folder and tiny random Llamas built in code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Without CUDA, the Triton decode kernel runs in Triton's interpreter on CPU tensors. Triton
# reads this when it is first imported, so it is set before any test imports it.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from workers.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def build_tiny_llama(folder: Path, tokenizer, **overrides) -> Path:
    """A random Llama small enough to run in milliseconds, saved as a HF checkpoint.

    Weights are drawn wider than HF's default init so that next-token distributions are
    peaked: greedy comparisons then test the engine, not float noise between near ties.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, tokenizer) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer)


def pytest_collection_modifyitems(config, items):
    """Without a CUDA device, every test marked `cuda` is skipped with one reason."""
    from tests.devices import HAS_CUDA, NO_CUDA

    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
