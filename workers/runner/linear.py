"""Dense projections on the fastest GEMM this PyTorch build has.

On x86 CPUs PyTorch sends float32 `F.linear` to MKL, which on AMD parts takes a generic code
path: about half of what the same cores do through oneDNN's matmul (`bench/archive/cpu_gemm.py` on a
2-core EPYC: 1.3-2.3x on SmolLM2's shapes from 16 rows up, 2.5-3.0x for the LM head at any
row count; mixed at 1-4 rows, where the small matmuls are latency, not FLOPs). oneDNN reads
the same dense weight in place, so switching costs no memory and no copy. Its rows are also
batch-invariant from two rows up, which MKL's small-batch kernels are not.

`torch.ops.mkldnn._linear_pointwise` is the op Inductor's CPU backend emits for a linear;
it is private, so `pick_linear_backend` checks that it exists and falls back to `F.linear`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.runner import cbuild, cpu_amx

LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

logger = logging.getLogger(__name__)

LINEAR_BACKENDS = ("auto", "torch", "onednn", "onednn_packed", "onednn_upcast", "amx",
                   "avx512_bf16")
# the backends that keep a tile-layout copy of each weight, and the `cpu_amx` kernel reading it
TILE_KERNELS = {"amx": "amx", "avx512_bf16": "dot"}
# The row count weights are blocked for under `onednn_packed`: a decode batch of the standard
# workload. The blocked weight serves any row count (bench/archive/cpu_gemm.py --packed 64).
PACK_ROWS_HINT = 64
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# the backends whose weights are blocked once at load (`LlamaModel.pack_linears`)
PACKED_BACKENDS = ("onednn_packed", "onednn_upcast", *TILE_KERNELS)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                              "_linear_pointwise")


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether this CPU runs oneDNN's matmul in `dtype`, by a tiny trial (once per dtype).

    The build may have the op while the CPU lacks the instructions: bfloat16 needs AVX-512
    (BF16/VNNI) or AMX, and on an AVX2-only CPU oneDNN answers "could not create a primitive
    descriptor". A trial is the one test that cannot disagree with the op itself."""
    if dtype not in _ONEDNN_DTYPES or not onednn_available():
        return False
    try:
        x = torch.ones(2, 16, dtype=dtype)
        out = onednn_linear(x, torch.ones(8, 16, dtype=dtype))
    except RuntimeError as exc:
        logger.info("oneDNN linear cannot run %s on this CPU (%s); using torch", dtype,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    return bool(torch.all(out == 16).item())


def native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions. oneDNN also runs bfloat16 on
    AVX-512 CPUs without them, by emulation, slower than float32: so the flags, not a trial."""
    return not cbuild.cpu_flags().isdisjoint(_NATIVE_BF16_FLAGS)


def pick_linear_backend(name: str, device: torch.device, dtype: torch.dtype, *,
                        quantized: bool = False) -> str:
    """`auto` is oneDNN on CPU for float32/bfloat16 where this build and this CPU run it
    (`onednn_runs`), else torch; float weights are blocked once at load (`onednn_packed`:
    float32 1.3x faster decode steps at 8 rows, 3-5% more standard-workload tok/s on an
    AVX-512 EPYC, no loss measured on an AVX2 one; bfloat16 on an AMX Xeon 1.3-2.1x faster
    matmuls at 1-64 rows, 9% more standard-workload tok/s). bfloat16 on a CPU with AMX is
    `amx`: the same blocked weights for many rows, and a second copy in AMX's tile layout
    for up to `cpu_amx.MAX_ROWS` rows (`cpu_amx`). Without AMX, bfloat16 on an AMD CPU with
    AVX-512 BF16 is `avx512_bf16`: the same copy read by BF16 dot products
    (`cpu_amx.dot_preferred`; selectable on any CPU with the instructions). bfloat16 on a
    CPU without bfloat16 dot products is `onednn_upcast`: float32 blocked weights, the
    activations widened per matmul and the outputs rounded back, a bfloat16 GEMM with float32
    accumulation at float32's speed, where oneDNN's emulated bfloat16 ran 3.5-4.5x slower
    (55 against 190-230 GFLOP/s on a Xeon without AVX-512 BF16; twice the weights' memory).
    Int8 weights (`quantized`) stay dense: they are cast per call.

    Asking for `onednn` where it cannot run is an error, not a silent fallback.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}")
    if name == "torch":
        return "torch"
    fits = device.type == "cpu" and dtype in _ONEDNN_DTYPES and onednn_available()
    if name == "auto":
        if not fits:
            return "torch"
        runs = onednn_runs(dtype)
        if quantized:
            return "onednn" if runs else "torch"
        if runs and dtype == torch.bfloat16 and cpu_amx.available():
            return "amx"
        if runs and dtype == torch.bfloat16 and cpu_amx.dot_preferred():
            return "avx512_bf16"
        if upcast_preferred(dtype):
            return "onednn_upcast"
        return "onednn_packed" if runs else "torch"
    if name == "amx" and not (dtype == torch.bfloat16 and cpu_amx.available()):
        raise ValueError("linear_backend 'amx' needs bfloat16 and a CPU with AMX "
                         "(amx_tile, amx_bf16) that Linux lets this process use")
    if name == "avx512_bf16" and not (dtype == torch.bfloat16 and cpu_amx.dot_available()):
        raise ValueError("linear_backend 'avx512_bf16' needs bfloat16 and a CPU with "
                         "AVX-512 BF16 (avx512_bf16)")
    if not fits:
        raise ValueError(f"linear_backend {name!r} needs a CPU device, float32 or bfloat16, "
                         "and a PyTorch built with oneDNN")
    if name == "onednn_upcast":
        if dtype != torch.bfloat16 or quantized or not onednn_runs(torch.float32):
            raise ValueError("linear_backend 'onednn_upcast' needs bfloat16 float weights and "
                             "oneDNN's float32 matmul")
        return name
    if not onednn_runs(dtype):
        raise ValueError(f"linear_backend {name!r} cannot run {dtype} on this CPU "
                         "(bfloat16 needs AVX-512 BF16 or AMX)")
    return name


def upcast_preferred(dtype: torch.dtype) -> bool:
    """bfloat16 on a CPU that only emulates it (or cannot run it), where float32 runs."""
    return dtype == torch.bfloat16 and not native_bf16() and onednn_runs(torch.float32)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` through oneDNN's matmul, reading the dense weight as it is."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def upcast_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """A bfloat16 matmul as float32: `x` widened (exact), float32 `weight` and `bias` (the
    bfloat16 ones widened at load), the float32 sums rounded once to `x`'s dtype."""
    return onednn_linear(x.float(), weight, bias).to(x.dtype)


def linear_kernel(backend: str) -> LinearKernel:
    """oneDNN's op serves both the dense weight and one `pack_weight` reordered."""
    if backend == "onednn_upcast":
        return upcast_linear
    return onednn_linear if backend in ("onednn", "onednn_packed", *TILE_KERNELS) else F.linear


def pack_weight(weight: torch.Tensor, rows_hint: int = PACK_ROWS_HINT) -> torch.Tensor:
    """The weight reordered once into oneDNN's blocked layout (an opaque mkldnn tensor), so
    no call reorders it again: 1.1-1.3x at 32-64 rows and 1.6-1.9x at 8 on a 2-core AVX2
    EPYC, bit-identical from 8 rows up (docs/benchmarks.md)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


class Linear(nn.Linear):
    """`nn.Linear` whose matmul is the runner's chosen kernel (set after loading)."""

    kernel: LinearKernel = staticmethod(F.linear)
    amx_weight: torch.Tensor | None = None  # the tile-layout copy (`TILE_KERNELS` backends)
    tile_kernel: str = "amx"  # the `cpu_amx` kernel that reads it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx_weight is not None and cpu_amx.fits(x, self.tile_kernel):
            out = cpu_amx.amx_linear(x, self.amx_weight, self.out_features,
                                     kernel=self.tile_kernel)
            return out if self.bias is None else out + self.bias
        return self.kernel(x, self.weight, self.bias)
