"""Which attention backend a runner gets, and that asking for an impossible one fails loudly."""

from __future__ import annotations

import pytest
import torch

from workers.runner.model_runner import pick_attention_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_torch_on_cpu_and_the_kernel_on_cuda():
    assert pick_attention_backend("auto", CPU, 16, 64) == "torch"
    assert pick_attention_backend("auto", CUDA, 16, 64) == "triton"
    assert pick_attention_backend("torch", CUDA, 16, 64) == "torch"


def test_auto_keeps_torch_where_the_kernel_does_not_fit():
    assert pick_attention_backend("auto", CUDA, 12, 64) == "torch"
    assert pick_attention_backend("auto", CUDA, 16, 512) == "torch"


@pytest.mark.parametrize(
    ("name", "device", "block_size", "match"),
    [
        ("flash", CPU, 16, "must be one of auto, torch, triton"),
        ("triton", CUDA, 12, "power-of-two block_size"),
    ],
)
def test_impossible_backends_are_refused(name, device, block_size, match):
    with pytest.raises(ValueError, match=match):
        pick_attention_backend(name, device, block_size, 64)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pick_attention_backend("triton", CPU, 16, 64) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        pick_attention_backend("triton", CPU, 16, 64)
