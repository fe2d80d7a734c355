"""Causal prefill attention on Intel AMX tiles (`csrc/amx_attention.c`), bfloat16, head 64.

One call serves a whole chunk, after cached context or not: the context's K/V (gathered from
the pool) and the chunk's own are packed once into tile layout, then each head's 16-query
blocks walk the keys 128 at a time with an online softmax (flash attention's order). It
replaces `flash_prefill`'s two calls of PyTorch's flash CPU kernel and their merge where it
runs (`prefill_attention: amx`); docs/benchmarks.md has the comparison.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from workers.runner import cbuild, cpu_amx

HEAD_DIM = 64  # the kernel's one head size
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


@functools.cache
def load_library(march: str = "native") -> ctypes.CDLL:
    """Built once per source, flags and CPU (`cbuild`); RuntimeError if it cannot be."""
    lib = cbuild.build_and_load("amx_attention", "CPU AMX prefill attention kernel", march)
    lib.amx_prefill_attention.restype = ctypes.c_int
    lib.amx_prefill_attention.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64,
                                          _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                                          ctypes.c_float, ctypes.c_int]
    return lib


def fits(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """bfloat16 heads of 64 on a CPU whose AMX this process may use."""
    return (dtype == torch.bfloat16 and head_dim == HEAD_DIM and device.type == "cpu"
            and cpu_amx.available())


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_ctx: torch.Tensor | None, v_ctx: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """q [q_len, heads, 64]; the chunk's k_new, v_new [q_len, kv_heads, 64]; the cached
    context before it k_ctx, v_ctx [kv_heads, context, 64] or None (views are fine where
    the last dimension is dense). Query i sits at position context + i and sees every
    position up to its own. Returns [q_len, heads, 64]."""
    q_len, heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    assert head_dim == HEAD_DIM and q.dtype == k_new.dtype == v_new.dtype == torch.bfloat16
    assert k_new.stride() == v_new.stride() and k_new.stride(-1) == q.stride(-1) == 1
    if k_ctx is None or v_ctx is None or k_ctx.shape[1] == 0:
        k_ctx = v_ctx = k_new.new_empty(kv_heads, 0, head_dim)
    assert k_ctx.stride() == v_ctx.stride() and k_ctx.stride(-1) == 1
    out = torch.empty(q_len, heads, head_dim, dtype=q.dtype)
    status = load_library().amx_prefill_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_ctx.data_ptr(), v_ctx.data_ptr(),
        k_ctx.stride(0), k_ctx.stride(1), k_new.data_ptr(), v_new.data_ptr(), k_new.stride(0),
        k_new.stride(1), out.data_ptr(), out.stride(0), out.stride(1), q_len, k_ctx.shape[1],
        heads, kv_heads, scale, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the AMX prefill attention kernel failed ({status})")
    return out
