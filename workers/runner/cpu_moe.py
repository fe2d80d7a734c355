"""float32 mixture-of-experts matmuls on CPU (`csrc/moe_gemm.c`): every expert of a
projection in one call, over weights packed once into 16-column blocks.

PyTorch's `_grouped_mm` on CPU is a loop of one matmul per expert (an MKL call on a transposed
weight view, and a host read of each expert's count); at decode sizes it read Qwen3-MoE-shaped
experts at a fraction of the memory bandwidth (`bench/moe_experts.py`). bfloat16 experts go
through the tile kernels instead (`cpu_amx.grouped_linear`).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from workers.runner import cbuild

logger = logging.getLogger(__name__)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


@functools.cache
def load_library(march: str = "native") -> ctypes.CDLL:
    """Built once per source, flags and CPU (`cbuild`); RuntimeError if it cannot be."""
    lib = cbuild.build_and_load("moe_gemm", "CPU mixture-of-experts matmul kernel", march)
    lib.moe_pack_f32.restype = _INT
    lib.moe_pack_f32.argtypes = [_P, _P, _I64, _I64]
    lib.moe_gemm_f32.restype = _INT
    lib.moe_gemm_f32.argtypes = [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT]
    return lib


@functools.cache
def available(march: str = "native") -> bool:
    try:
        load_library(march)
    except RuntimeError as exc:
        logger.warning("float32 MoE kernel unavailable, using PyTorch's matmuls: %s", exc)
        return False
    return True


def packable(weights: torch.Tensor) -> bool:
    """Stacked float32 expert weights [experts, out, in] on CPU, out a multiple of 16."""
    return (weights.dtype == torch.float32 and weights.dim() == 3
            and weights.device.type == "cpu" and weights.shape[1] % 16 == 0)


def pack_experts(weights: torch.Tensor, *, march: str = "native") -> torch.Tensor:
    """[experts, out, in] -> [experts, out * in] in the kernel's layout (the same size)."""
    assert packable(weights)
    experts, out_features, in_features = weights.shape
    dense = weights.detach().contiguous()
    packed = torch.empty(experts, out_features * in_features, dtype=torch.float32)
    lib = load_library(march)
    for e in range(experts):
        if lib.moe_pack_f32(dense[e].data_ptr(), packed[e].data_ptr(), out_features,
                            in_features) != 0:
            raise ValueError(f"cannot pack a {tuple(weights.shape)} expert stack")
    return packed


def grouped_linear(x: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor,
                   out_features: int, *, out: torch.Tensor | None = None,
                   march: str = "native") -> torch.Tensor:
    """Rows offsets[e]:offsets[e + 1] of x [rows, in] (float32) times expert e's weight
    (`pack_experts`), every expert in one call (into `out` where given). `offsets`: int64
    [experts + 1], from 0 to rows."""
    assert x.dtype == torch.float32 and x.dim() == 2 and offsets.dtype == torch.int64
    rows = x if x.stride(1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    assert out.shape == (rows.shape[0], out_features) and out.stride(1) == 1
    offsets = offsets.contiguous()
    status = load_library(march).moe_gemm_f32(
        rows.data_ptr(), packed.data_ptr(), out.data_ptr(), offsets.data_ptr(),
        packed.shape[0], out_features, rows.shape[1], rows.stride(0), out.stride(0),
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the MoE kernel cannot multiply {tuple(rows.shape)} by "
                         f"{packed.shape[0]} experts of {out_features} columns")
    return out
