"""bfloat16 matmuls of few rows on Intel AMX or AVX-512 BF16 (`csrc/amx_gemm.c`), for decode
steps.

A decode step's projections are bound by reading the weights once. oneDNN's blocked bfloat16
matmul read SmolLM2's weights at 11-15 GB/s at 1-64 rows on a 2-core AMX Xeon VM whose
plain read ran at 23 GB/s; this kernel streams a weight packed once into AMX's tile layout
at 12-20 GB/s there (1.17-1.41x, `bench/archive/amx_gemm.py`, docs/benchmarks.md). At many rows
(long prefill chunks) oneDNN is faster, so the `amx` linear backend keeps both copies and
picks by rows.

CPUs with AVX-512 BF16 but no AMX (AMD Zen 4, Intel Cooper Lake, or a VM that refuses the tile
state) get the same layout read by the `dot` kernel: BF16 dot products of 16 columns x one
k-pair, 6-12 rows per weight vector. On a 2-core Zen 4 it ran the step's 120 projections at
1.27x oneDNN's speed at 64 rows, 1.29x at 32, 1.36-1.39x at 1-16 and 1.02x at 128
(`bench/archive/amx_gemm.py --kernel dot`).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from workers.runner import cbuild

logger = logging.getLogger(__name__)

# Above this many rows oneDNN's blocked matmul is the faster one (bench/archive/amx_gemm.py).
MAX_ROWS = {"amx": 512, "dot": 256}
KERNELS = tuple(MAX_ROWS)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


@functools.cache
def load_library(march: str = "native") -> ctypes.CDLL:
    """Built once per source, flags and CPU (`cbuild`); RuntimeError if it cannot be."""
    lib = cbuild.build_and_load("amx_gemm", "CPU AMX matmul kernel", march)
    lib.amx_init.restype = _INT
    lib.amx_init.argtypes = []
    lib.amx_pack.restype = _INT
    lib.amx_pack.argtypes = [_P, _P, _I64, _I64]
    for gemm in (lib.amx_gemm, lib.dot_gemm):
        gemm.restype = _INT
        gemm.argtypes = [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _INT]
    for grouped in (lib.amx_grouped_gemm, lib.dot_grouped_gemm):
        grouped.restype = _INT
        grouped.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT, _INT]
    return lib


@functools.cache
def available() -> bool:
    """Whether this CPU has AMX bfloat16, the kernel builds, and Linux grants the tile state
    (logged once when a CPU with AMX cannot use it)."""
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= cbuild.cpu_flags():
        return False
    try:
        granted = load_library().amx_init() == 0
    except RuntimeError as exc:
        logger.warning("CPU AMX matmul kernel unavailable: %s", exc)
        return False
    if not granted:
        logger.warning("CPU AMX matmul kernel unavailable: Linux refused the AMX tile state")
    return granted


@functools.cache
def dot_available() -> bool:
    """Whether this CPU has AVX-512 BF16 and the `dot` kernel builds and multiplies right
    (one tiny product, checked, so a build without the instructions never gets picked)."""
    if "avx512_bf16" not in cbuild.cpu_flags():
        return False
    try:
        ones = torch.ones(32, 32, dtype=torch.bfloat16)
        out = amx_linear(torch.ones(2, 32, dtype=torch.bfloat16), pack(ones), 32, kernel="dot")
    except (RuntimeError, ValueError) as exc:
        logger.warning("CPU AVX-512 BF16 matmul kernel unavailable: %s", exc)
        return False
    return bool(torch.all(out == 32).item())


def dot_preferred() -> bool:
    """Where `auto` takes the dot kernel (when AMX is not there): AMD's AVX-512 BF16 cores
    (Zen 4), on which it beat oneDNN 1.27-1.39x at 1-64 rows. On an Intel Xeon (Emerald
    Rapids, 2 threads) it ran at 0.19-0.5x of oneDNN's AMX matmul from 16 rows up; Intel
    CPUs with AVX-512 BF16 and no AMX are not measured, so they keep oneDNN."""
    return cbuild.cpu_vendor() == "AuthenticAMD" and dot_available()


def kernel_available(kernel: str) -> bool:
    return available() if kernel == "amx" else dot_available()


def copy_fits(nbytes: int, available: int | None = None) -> bool:
    """Whether a second copy of `nbytes` of weights may be made: at most a quarter of the
    memory available now (after loading), so `auto` never trades the KV cache's room, or
    the machine's, for faster matmuls; an explicit `amx` makes the copy regardless."""
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return nbytes <= available // 4


def packable(weight: torch.Tensor) -> bool:
    """A dense bfloat16 [out, in] weight whose sizes the tile layout covers (multiples of 32)."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.layout == torch.strided and weight.shape[0] % 32 == 0
            and weight.shape[1] % 32 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in AMX's B-tile layout: a flat bfloat16 tensor of the same size."""
    assert packable(weight)
    out_features, in_features = weight.shape
    dense = weight.detach().contiguous()
    packed = torch.empty(out_features * in_features, dtype=torch.bfloat16)
    if load_library().amx_pack(dense.data_ptr(), packed.data_ptr(), out_features,
                               in_features) != 0:
        raise ValueError(f"cannot pack a {tuple(weight.shape)} weight for AMX")
    return packed


def fits(x: torch.Tensor, kernel: str = "amx") -> bool:
    """Rows the kernel takes, few enough to beat oneDNN."""
    return _takes(x) and x.numel() // x.shape[-1] <= MAX_ROWS[kernel]


def _takes(x: torch.Tensor) -> bool:
    """bfloat16 rows on CPU (any number), the last dimension dense."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() >= 2
            and x.numel() >= x.shape[-1] > 0 and x.stride(-1) == 1)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, *,
               out_dtype: torch.dtype = torch.bfloat16, kernel: str = "amx") -> torch.Tensor:
    """`x @ weight.T` for x [..., in] bfloat16 with the weight from `pack`; out in bfloat16
    or float32 (sums are float32 either way), by AMX tiles or AVX-512 BF16 dot products
    (`kernel`). Any number of rows: `fits` is the policy."""
    assert _takes(x) and out_dtype in (torch.bfloat16, torch.float32) and kernel in KERNELS
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    if rows.stride(0) < in_features:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=out_dtype)
    lib = load_library()
    status = (lib.amx_gemm if kernel == "amx" else lib.dot_gemm)(
        rows.data_ptr(), packed.data_ptr(), out.data_ptr(), rows.shape[0], out_features,
        in_features, rows.stride(0), out.stride(0), int(out_dtype == torch.float32),
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the {kernel} kernel cannot multiply {tuple(rows.shape)} by a "
                         f"{out_features}-column weight")
    return out.view(*x.shape[:-1], out_features)


def pack_experts(weights: torch.Tensor) -> torch.Tensor:
    """Stacked expert weights [experts, out, in] in the tile layout, one expert after another
    ([experts, out * in] bfloat16): the stack packed as one [experts * out, in] weight, since
    each expert's columns are whole 32-column blocks."""
    experts, out_features, in_features = weights.shape
    return pack(weights.reshape(experts * out_features, in_features)).view(experts, -1)


def grouped_linear(x: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor,
                   out_features: int, *, kernel: str = "amx",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Mixture-of-experts rows: rows offsets[e]:offsets[e + 1] of x [rows, in] (bfloat16)
    times expert e's weight (`pack_experts`), every expert in one call; out bfloat16 (into
    `out`, [rows, out_features] with dense rows, where given). `offsets`: int64
    [experts + 1], from 0 to rows."""
    assert _takes(x) and kernel in KERNELS and offsets.dtype == torch.int64
    experts = packed.shape[0]
    in_features = x.shape[-1]
    rows = x if x.stride(0) >= in_features else x.contiguous()
    if out is None:
        out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    assert out.shape == (rows.shape[0], out_features) and out.dtype == torch.bfloat16
    assert out.stride(1) == 1
    offsets = offsets.contiguous()
    lib = load_library()
    status = (lib.amx_grouped_gemm if kernel == "amx" else lib.dot_grouped_gemm)(
        rows.data_ptr(), packed.data_ptr(), out.data_ptr(), offsets.data_ptr(), experts,
        out_features, in_features, rows.stride(0), out.stride(0), 0, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the {kernel} kernel cannot multiply {tuple(rows.shape)} by "
                         f"{experts} experts of {out_features} columns")
    return out
