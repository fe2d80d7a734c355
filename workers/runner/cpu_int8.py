"""Few-row matmuls with int8 weights on CPU (`csrc/int8_gemv.c`): the weight read once as
int8 and widened in registers, instead of cast to a float buffer first.

At one to `MAX_ROWS` rows a projection is bound by reading its weight; int8 is a quarter of
float32's bytes, but the cast path writes and rereads the weight at float width, so int8
weights were slower than float32 there (docs/benchmarks.md). `quantization.int8_linear` uses
this kernel for float32 activations of up to `MAX_ROWS` rows where it builds.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from workers.runner import cbuild

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # the kernel's limit (csrc/int8_gemv.c)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


@functools.cache
def load_library(march: str = "native") -> ctypes.CDLL:
    """Built once per source, flags and CPU (`cbuild`); RuntimeError if it cannot be."""
    lib = cbuild.build_and_load("int8_gemv", "CPU int8 matmul kernel", march)
    lib.int8_gemv.restype = _INT
    lib.int8_gemv.argtypes = [_P, _P, _P, _P, _P, _INT, _I64, _I64, _I64, _I64, _INT]
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here (logged once when it does not)."""
    try:
        load_library()
    except RuntimeError as exc:
        logger.warning("CPU int8 matmul kernel unavailable, casting weights instead: %s", exc)
        return False
    return True


def fits(x: torch.Tensor) -> bool:
    """float32 rows on CPU, few enough for the kernel, the last dimension dense."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1)


def int8_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, *, march: str = "native") -> torch.Tensor:
    """`(x @ qweight.T) * scale + bias` for x [rows <= MAX_ROWS, in] float32 (rows may be
    strided), qweight [out, in] int8, scale and bias [out] float32."""
    rows, in_features = x.shape
    out_features = qweight.shape[0]
    assert fits(x) and qweight.dtype == torch.int8 and qweight.is_contiguous()
    assert qweight.shape[1] == in_features and scale.dtype == torch.float32
    assert scale.is_contiguous() and (bias is None or (bias.dtype == torch.float32
                                                       and bias.is_contiguous()))
    out = torch.empty(rows, out_features, dtype=torch.float32)
    status = load_library(march).int8_gemv(
        x.data_ptr(), qweight.data_ptr(), scale.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, out_features,
        in_features, x.stride(0), out.stride(0), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the int8 kernel takes 1 to {MAX_ROWS} rows, not {rows}")
    return out
