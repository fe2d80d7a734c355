"""Causal prefill attention on Intel AMX tiles (`csrc/amx_attention.c`), bfloat16, heads of 64
or 128.

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

from workers.runner import cbuild, cpu_amx, vec_prefill

HEAD_DIMS = (64, 128)  # the kernel's head sizes
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


@functools.cache
def load_library(march: str = "native") -> ctypes.CDLL:
    """Built once per source, flags and CPU (`cbuild`); RuntimeError if it cannot be."""
    lib = cbuild.build_and_load("amx_attention", "CPU AMX prefill attention kernel", march)
    lib.amx_prefill_attention.restype = ctypes.c_int
    lib.amx_prefill_attention.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64,
                                          _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                                          _I64, ctypes.c_float, ctypes.c_int, _I64]
    return lib


def fits(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """bfloat16 heads of 64 or 128 on a CPU whose AMX this process may use."""
    return (dtype == torch.bfloat16 and head_dim in HEAD_DIMS and device.type == "cpu"
            and cpu_amx.available())


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      k_ctx: torch.Tensor | None, v_ctx: torch.Tensor | None,
                      scale: float, *, window: int | None = None) -> torch.Tensor:
    """q [q_len, heads, dim] (dim 64 or 128); the chunk's k_new, v_new [q_len, kv_heads, dim];
    the cached context before it k_ctx, v_ctx [kv_heads, context, dim] or None (views are fine where
    the last dimension is dense). Query i sits at position context + i and sees every
    position up to its own; with a `window`, only the `window` most recent of them (its own
    included). Returns [q_len, heads, dim]."""
    assert q.shape[-1] in HEAD_DIMS and q.dtype == torch.bfloat16
    out, args = vec_prefill.chunk_arguments(q, k_new, v_new, k_ctx, v_ctx)
    status = load_library().amx_prefill_attention(*args, q.shape[-1], scale,
                                                  torch.get_num_threads(),
                                                  window or 0)
    if status != 0:
        raise RuntimeError(f"the AMX prefill attention kernel failed ({status})")
    return out
