"""One-pass element-wise kernels for float32 and bfloat16 on CPU: SiLU-and-multiply, residual
add with RMSNorm, RoPE in place, and the new K/V rows' copy into the pool (`csrc/fused_ops.c`;
bfloat16 is computed in float32 and rounded once per result).

On a CPU these parts are memory passes, and PyTorch makes several per part (RMSNorm alone is
six kernels, each writing a fresh tensor). Profiled over the standard workload they were about
a seventh of the engine's time; each is one pass here. `elementwise=auto` uses them where
they build (float32 or bfloat16 on CPU); `torch` keeps PyTorch's ops, for other dtypes and
devices.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from workers.runner import cbuild

logger = logging.getLogger(__name__)

ELEMENTWISE = ("auto", "torch", "cpu")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
# each kernel's name suffix for the tensors' dtype
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
# each kernel's arguments (the same for every dtype)
_SIGNATURES = {
    "silu_mul": [_P, _P, _I64, _I64, _I64, _I64, _INT],
    "add_rms_norm": [_P, _P, _P, _P, _I64, _I64, ctypes.c_float, _INT, _INT],
    "rope": [_P, _P, _P, _P, _I64, _I64, _INT, _INT, _INT],
    "store_kv": [_P, _I64, _I64, _I64, _INT, _INT, _P, _P, _P, _INT],
    "moe_sum": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _INT],
}


@functools.cache
def load_library(march: str = "native") -> ctypes.CDLL:
    """Built once per source, flags and CPU (`cbuild`; tests pass other `march` targets);
    RuntimeError if it cannot be."""
    lib = cbuild.build_and_load("fused_ops", "CPU element-wise kernels", march)
    for suffix in _SUFFIX.values():
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.restype = None
            fn.argtypes = argtypes
    return lib


def _kernel(name: str, dtype: torch.dtype, march: str) -> ctypes._CFuncPtr:
    return getattr(load_library(march), f"{name}_{_SUFFIX[dtype]}")


def pick_elementwise(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto`: the C kernels for float32 or bfloat16 on CPU where they build, else torch.
    Asking for `cpu` where they cannot run is an error, not a silent fallback."""
    if name not in ELEMENTWISE:
        raise ValueError(f"elementwise must be one of {', '.join(ELEMENTWISE)}")
    if name == "torch":
        return "torch"
    fits = device.type == "cpu" and dtype in _SUFFIX
    if name == "cpu" and not fits:
        raise ValueError("elementwise 'cpu' needs a CPU device and float32 or bfloat16")
    if not fits:
        return "torch"
    try:
        load_library()
    except RuntimeError as exc:
        if name == "cpu":
            raise ValueError(str(exc)) from exc
        logger.warning("CPU element-wise kernels unavailable, using torch's: %s", exc)
        return "torch"
    return "cpu"


def _threads() -> int:
    return torch.get_num_threads()


def silu_mul(gate_up: torch.Tensor, *, march: str = "native",
             out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [rows, 2n] (gate first), as one [rows, n] tensor (into
    `out`, a [rows, n] tensor with dense rows, where given)."""
    rows, width = gate_up.shape
    n = width // 2
    assert gate_up.stride(1) == 1
    if out is None:
        out = torch.empty(rows, n, dtype=gate_up.dtype)
    assert out.shape == (rows, n) and out.dtype == gate_up.dtype and out.stride(1) == 1
    _kernel("silu_mul", gate_up.dtype, march)(gate_up.data_ptr(), out.data_ptr(), rows, n,
                                              gate_up.stride(0), out.stride(0), _threads())
    return out


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, *, march: str = "native") -> torch.Tensor:
    """residual += x (unless x is None), in place; returns rmsnorm(residual) * weight."""
    rows, n = residual.shape
    assert residual.is_contiguous() and weight.dtype == residual.dtype
    if x is not None:
        assert x.is_contiguous() and x.shape == residual.shape and x.dtype == residual.dtype
    out = torch.empty_like(residual)
    _kernel("add_rms_norm", residual.dtype, march)(
        0 if x is None else x.data_ptr(), residual.data_ptr(), out.data_ptr(),
        weight.data_ptr(), rows, n, eps, int(x is not None), _threads())
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          heads: int, head_dim: int, *, march: str = "native") -> None:
    """Rotate the first `heads` heads of every row of x ([tokens, >= heads * head_dim], rows
    may be strided) in place; cos/sin: the model's [max_positions, head_dim / 2] tables."""
    tokens = x.shape[0]
    assert cos.dtype == sin.dtype == torch.float32 and x.stride(-1) == 1
    assert positions.dtype == torch.long and positions.is_contiguous()
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] * 2 == head_dim
    _kernel("rope", x.dtype, march)(x.data_ptr(), positions.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), tokens, x.stride(0), heads, head_dim,
                                    _threads())


def store_kv(qkv: torch.Tensor, k_col: int, kv_heads: int, head_dim: int, rows: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, *, march: str = "native") -> None:
    """Copy each token's K and V heads, found in its qkv row from column `k_col` on (K, then
    V), into the pools at `rows` ([tokens * kv_heads], rows of the pools viewed as
    [-1, head_dim]): one pass, where PyTorch made contiguous copies and then indexed them."""
    tokens = qkv.shape[0]
    assert qkv.stride(-1) == 1 and k_cache.dtype == v_cache.dtype == qkv.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[-1] == head_dim
    assert rows.dtype == torch.long and rows.is_contiguous() and rows.numel() == tokens * kv_heads
    _kernel("store_kv", qkv.dtype, march)(qkv.data_ptr(), tokens, qkv.stride(0), k_col,
                                          kv_heads, head_dim, rows.data_ptr(),
                                          k_cache.data_ptr(), v_cache.data_ptr(), _threads())


def moe_sum(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, *,
            march: str = "native") -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * rows[index[t, j]] ([tokens, n], rows' dtype; float32 sums):
    a mixture-of-experts layer's outputs, one row per (token, expert) pair in the experts'
    order, gathered back to their tokens and weighted by the router. `index` int64 and
    `weights` float32, both [tokens, k]."""
    tokens, k = index.shape
    n = rows.shape[1]
    assert rows.stride(1) == 1 and index.dtype == torch.int64 and weights.dtype == torch.float32
    index, weights = index.contiguous(), weights.contiguous()
    assert weights.shape == index.shape
    out = torch.empty(tokens, n, dtype=rows.dtype)
    _kernel("moe_sum", rows.dtype, march)(rows.data_ptr(), index.data_ptr(), weights.data_ptr(),
                                          out.data_ptr(), tokens, k, n, rows.stride(0),
                                          out.stride(0), _threads())
    return out
