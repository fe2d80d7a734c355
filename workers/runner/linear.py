"""Dense projections on the fastest GEMM this PyTorch build has.

On x86 CPUs PyTorch sends float32 `F.linear` to MKL, which on AMD parts takes a generic code
path: about half of what the same cores do through oneDNN's matmul (`bench/cpu_gemm.py` on a
2-core EPYC: 1.3-2.3x on SmolLM2's shapes from 16 rows up, 2.5-3.0x for the LM head at any
row count; mixed at 1-4 rows, where the small matmuls are latency, not FLOPs). oneDNN reads
the same dense weight in place, so switching costs no memory and no copy. Its rows are also
batch-invariant from two rows up, which MKL's small-batch kernels are not.

`torch.ops.mkldnn._linear_pointwise` is the op Inductor's CPU backend emits for a linear;
it is private, so `pick_linear_backend` checks that it exists and falls back to `F.linear`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

LINEAR_BACKENDS = ("auto", "torch", "onednn")
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                              "_linear_pointwise")


def pick_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` is oneDNN on CPU for float32/bfloat16 when this build has it, else torch.

    Asking for `onednn` where it cannot run is an error, not a silent fallback.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}")
    if name == "torch":
        return "torch"
    fits = device.type == "cpu" and dtype in _ONEDNN_DTYPES and onednn_available()
    if name == "auto":
        return "onednn" if fits else "torch"
    if not fits:
        raise ValueError("linear_backend 'onednn' needs a CPU device, float32 or bfloat16, "
                         "and a PyTorch built with oneDNN")
    return "onednn"


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` through oneDNN's matmul, reading the dense weight as it is."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear_kernel(backend: str) -> LinearKernel:
    return onednn_linear if backend == "onednn" else F.linear


class Linear(nn.Linear):
    """`nn.Linear` whose matmul is the runner's chosen kernel (set after loading)."""

    kernel: LinearKernel = staticmethod(F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)
