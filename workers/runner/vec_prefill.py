"""Causal prefill attention with vectors, queries in the lanes (`csrc/vec_attention.c`):
float32 with AVX-512 or AVX2+FMA, bfloat16 with AVX-512 BF16; heads of 64 or 128. On a CPU
without AVX-512 BF16, bfloat16 chunks are widened to float32 around the float32 kernel (`widens`):
the copies are a pass over q and K/V, small beside the chunk x context products.

One call serves a whole chunk, after cached context or not, like `amx_prefill` (whose
argument order it shares) on CPUs without AMX. It replaces `flash_prefill`'s two calls of
PyTorch's flash CPU kernel and their merge (`prefill_attention: vec`); `auto` picks it only
where it was timed faster, on AVX-512 (`preferred`). docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from workers.runner import cbuild

HEAD_DIMS = (64, 128)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


@functools.cache
def load_library(march: str = "native") -> ctypes.CDLL:
    """Built once per source, flags and CPU (`cbuild`); RuntimeError if it cannot be."""
    lib = cbuild.build_and_load("vec_attention", "CPU vector prefill attention kernel", march)
    lib.vec_prefill_supports.restype = _INT
    lib.vec_prefill_supports.argtypes = [_INT, _I64]
    lib.vec_prefill_attention.restype = _INT
    lib.vec_prefill_attention.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64,
                                          _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                                          _INT, ctypes.c_float, _INT, _I64]
    return lib


@functools.cache
def _supported(dtype: torch.dtype, head_dim: int, march: str = "native") -> bool:
    """Whether the `march` build takes this dtype and head size natively."""
    if dtype not in _DTYPE_CODES or head_dim not in HEAD_DIMS:
        return False
    flags = cbuild.cpu_flags()
    if "avx512f" not in flags and not {"avx2", "fma"} <= flags:
        return False
    try:
        return load_library(march).vec_prefill_supports(_DTYPE_CODES[dtype], head_dim) == 1
    except RuntimeError:
        return False


def widens(dtype: torch.dtype, head_dim: int, march: str = "native") -> bool:
    """bfloat16 that this build only takes through float32 (no AVX-512 BF16)."""
    if dtype != torch.bfloat16 or _supported(dtype, head_dim, march):
        return False
    return _supported(torch.float32, head_dim, march)


def fits(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """A CPU device, heads of 64 or 128, float32 on AVX-512 or AVX2+FMA, bfloat16 on any of
    them (natively on AVX-512 BF16, else widened)."""
    return device.type == "cpu" and (_supported(dtype, head_dim) or widens(dtype, head_dim))


def preferred(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Where `auto` takes it: AVX-512, on which it was 1.5-2.9x the flash split. The AVX2
    build runs (and is tested) but has not been timed on an AVX2-only CPU."""
    return fits(dtype, head_dim, device) and "avx512f" in cbuild.cpu_flags()


def chunk_arguments(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_ctx: torch.Tensor | None, v_ctx: torch.Tensor | None
                    ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The output tensor and the pointer/stride arguments every prefill kernel here takes, in
    order: q, context K/V, the chunk's K/V, out, then q_len, ctx_len, heads, kv_heads."""
    q_len, heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    assert q.dtype == k_new.dtype == v_new.dtype
    assert k_new.stride() == v_new.stride() and k_new.stride(-1) == q.stride(-1) == 1
    if k_ctx is None or v_ctx is None or k_ctx.shape[1] == 0:
        k_ctx = v_ctx = k_new.new_empty(kv_heads, 0, head_dim)
    assert k_ctx.stride() == v_ctx.stride() and k_ctx.stride(-1) == 1
    out = torch.empty(q_len, heads, head_dim, dtype=q.dtype)
    return out, (q.data_ptr(), q.stride(0), q.stride(1), k_ctx.data_ptr(), v_ctx.data_ptr(),
                 k_ctx.stride(0), k_ctx.stride(1), k_new.data_ptr(), v_new.data_ptr(),
                 k_new.stride(0), k_new.stride(1), out.data_ptr(), out.stride(0),
                 out.stride(1), q_len, k_ctx.shape[1], heads, kv_heads)


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_ctx: torch.Tensor | None, v_ctx: torch.Tensor | None,
                      scale: float, *, window: int | None = None,
                      march: str = "native") -> torch.Tensor:
    """q [q_len, heads, dim]; the chunk's k_new, v_new [q_len, kv_heads, dim]; the cached
    context before it k_ctx, v_ctx [kv_heads, context, dim] or None (views are fine where
    the last dimension is dense). Query i sits at position context + i and sees every
    position up to its own; with a `window`, only the `window` most recent of them (its own
    included). Returns [q_len, heads, dim]. `march`: the build (tests and
    bench/archive/prefill_attention.py run the AVX2 one on AVX-512 CPUs too)."""
    if q.dtype not in _DTYPE_CODES:
        raise ValueError(f"no vector prefill kernel for {q.dtype}")
    if widens(q.dtype, q.shape[-1], march):
        wide = [None if t is None else t.float() for t in (q, k_new, v_new, k_ctx, v_ctx)]
        return prefill_attention(*wide, scale, window=window, march=march).to(q.dtype)
    out, args = chunk_arguments(q, k_new, v_new, k_ctx, v_ctx)
    status = load_library(march).vec_prefill_attention(
        *args, q.shape[-1], _DTYPE_CODES[q.dtype], scale, torch.get_num_threads(),
        window or 0)
    if status != 0:  # -1: this build does not take the dtype or head size
        raise RuntimeError(f"the vector prefill attention kernel failed ({status})")
    return out
