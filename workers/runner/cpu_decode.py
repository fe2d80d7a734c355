"""Decode attention on CPU through a small C kernel that reads the paged pool in place.

The torch path gathers each decode row's blocks and runs SDPA over the copy: the context is
read twice and written once, and in float32 a decode step's KV is larger than the weights, so
that traffic was about a third of a step. The kernel (`csrc/paged_decode.c`) walks the block
table with an online softmax instead, reading each K/V byte once.

It is built at first use and called through ctypes with tensor pointers, releasing the GIL
meanwhile (`cbuild`).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from workers.runner import cbuild

logger = logging.getLogger(__name__)

# the C kernel's fixed limits (stack buffers)
MAX_GROUP, MAX_DIM, MAX_BLOCK = 16, 256, 256
# the pool's row type, as the kernel numbers it
_POOL_KINDS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}


def fits(group: int, head_dim: int, block_size: int, dtype: torch.dtype, *,
         int8_pool: bool = False) -> bool:
    """Whether the kernel serves this shape: a float32 model (float32 or int8 pool), or a
    bfloat16 one with a bfloat16 pool, within its fixed buffers."""
    dtype_fits = dtype == torch.float32 or (dtype == torch.bfloat16 and not int8_pool)
    return (dtype_fits and group <= MAX_GROUP and head_dim <= MAX_DIM
            and block_size <= MAX_BLOCK)


@functools.cache
def load_library(march: str = "native") -> ctypes.CDLL:
    """Build the kernel once per source, flags and CPU, then load it (`cbuild`; tests pass
    other `march` targets to check each code path).

    Raises RuntimeError for anything that stops it (the runner then falls back to torch under
    `auto`)."""
    lib = cbuild.build_and_load("paged_decode", "CPU decode kernel", march)
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [
        ctypes.c_int64, ctypes.c_int64, ctypes.c_float] + [ctypes.c_int] * 4 + [
        ctypes.c_float, ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether the kernel builds and loads here; it is built now (once per machine), so a
    failure shows at engine start, never mid-step."""
    try:
        load_library()
    except RuntimeError as exc:
        logger.warning("CPU decode kernel unavailable, using torch attention: %s", exc)
        return False
    return True


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int,
    *, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, plain: bool = False, march: str = "native",
) -> torch.Tensor:
    """q: [rows, heads, dim] (rows may be strided); tables [rows, blocks] and lens int32.
    The pool is float32 or bfloat16 like q, or int8 rows with their scales (`kv_quant`) for a
    float32 q, read in place; the output has q's dtype.

    `window`: each row attends to its last `window` positions, its own included (HF's
    sliding window, `attention.first_visible`); the blocks before them are not read.
    `softcap`: scores become `softcap * tanh(scores / softcap)` before the softmax.
    `sinks`: [heads] attention sinks (gpt-oss), one logit per head in each row's softmax
    denominator that adds no value (each row's online softmax starts from it).

    `plain` forces the portable loops where the build has AVX-512; `march` picks another
    build target (tests cover them all)."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    kind = _POOL_KINDS[k_cache.dtype]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
    assert q.dtype == k_cache.dtype or (q.dtype == torch.float32 and k_cache.dtype == torch.int8)
    assert block_tables.dtype == seq_lens.dtype == torch.int32
    assert block_tables.is_contiguous() and seq_lens.is_contiguous()
    out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype)
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        assert sinks.shape == (num_heads,)
    lib = load_library(march)
    status = lib.paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(),
        rows, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        q.stride(0), out.stride(0), scale, torch.get_num_threads(), int(plain), kind,
        window or 0, softcap or 0.0, None if sinks is None else sinks.data_ptr())
    if status != 0:
        raise ValueError("shape past the CPU decode kernel's limits "
                         f"(group <= {MAX_GROUP}, head_dim <= {MAX_DIM}, block <= {MAX_BLOCK})")
    return out
