"""Where a test runs: the CPU, or a CUDA device.

A test that needs CUDA carries the `cuda` marker (pyproject.toml); without a device,
tests/conftest.py skips every such test with `NO_CUDA` as its reason (`pytest -rs` prints it).
A test that runs on both takes its device from `DEVICES` (a parametrize list, or a fixture's
params), so the CPU variant keeps running everywhere and the CUDA variant is marked.

`bench/gpu_check.py` runs `pytest -m cuda` over the test files that hold CUDA tests, found by
reading them: a file that says `mark.cuda` or imports this module. So a fixture parametrized
with `DEVICES` lives in the test file that uses it, never in a conftest.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False here)"
# tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA device, before Triton loads
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NOT_INTERPRETED = ("Triton's interpreter is off (a CUDA device is present; the test's cuda "
                   "variant runs the kernel there)")


def on_cuda(*values: Any, id: str | None = None) -> Any:
    """A parametrize entry that runs on CUDA: marked `cuda`."""
    return pytest.param(*values, id=id, marks=pytest.mark.cuda)


# Engines and kernels on the CPU, and on the CUDA device where there is one.
DEVICES = (pytest.param("cpu", id="cpu"), on_cuda("cuda", id="cuda"))
# The Triton kernel: in its interpreter on CPU tensors where there is no GPU, else on CUDA.
TRITON_DEVICES = (
    pytest.param("cpu", id="interpreted", marks=pytest.mark.skipif(not INTERPRETED,
                                                                   reason=NOT_INTERPRETED)),
    on_cuda("cuda", id="cuda"),
)


def exact(device: str) -> dict[str, str]:
    """Engine arguments for token-exact comparisons with HF's float32 reference: float32 on
    either device (the engine's default on CUDA is bfloat16)."""
    return {"device": device, "dtype": "float32"}
