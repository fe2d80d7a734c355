"""A Triton kernel for decode attention that reads K/V straight from the paged pool.

The torch path gathers each decode row's blocks into a padded tensor and then runs SDPA over
it: the context is read twice and written once. This kernel walks the block table and keeps
an online softmax in registers, so each K/V byte is read once. It also needs no per-step
Python grouping, so its launch has fixed shapes (what a CUDA graph needs).

One program serves one sequence and one KV head, with all the query heads of that head's GQA
group as the rows of one tile. Importing this module imports Triton; only the CUDA backend
does, or a test on CPU tensors with `TRITON_INTERPRET=1` set before Triton is imported.

An int8 pool (`kv_quant`: head_dim int8 values, then the row's float32 scale) is read in place
too: int8 converts exactly to the query's dtype, the K scales multiply the scores and the V
scales the softmax weights.

A sliding window starts each row's walk at position len - window (the positions before it are
never loaded); soft-capping maps the scores through softcap * tanh(s / softcap) first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per loop iteration; tl.dot wants every dimension to be at least 16.
MIN_TILE = 16
TILE_TOKENS = 64


@triton.jit
def _paged_decode(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale, window, softcap,
    stride_q_tok, stride_q_head, stride_kv_block, stride_kv_head, stride_kv_tok,
    stride_o_tok, stride_o_head, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, INT8: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    offs = tl.arange(0, TILE)
    # the first position the row sees (window: 2**30 when the layer has none)
    for start in range(tl.maximum(seq_len - window, 0), seq_len, TILE):
        pos = start + offs
        pos_ok = pos < seq_len
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        base = block.to(tl.int64) * stride_kv_block + (pos % BLOCK_SIZE) * stride_kv_tok
        kv_off = base[:, None] + kv_head * stride_kv_head + dims[None, :]
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0)
        if INT8:  # each row's float32 scale sits right after its values
            scale_off = base + kv_head * stride_kv_head + HEAD_DIM
            k_scale = tl.load((k_ptr + scale_off).to(tl.pointer_type(tl.float32), bitcast=True),
                              mask=pos_ok, other=0.0)
            v_scale = tl.load((v_ptr + scale_off).to(tl.pointer_type(tl.float32), bitcast=True),
                              mask=pos_ok, other=0.0)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if INT8:
            s = s * k_scale[None, :]
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(s * (2.0 / softcap)) - 1.0)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        if INT8:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(
        out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int,
    out: torch.Tensor | None = None, *, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [rows, heads, dim], one query token per row; k_cache, v_cache: the layer's pool,
    [num_blocks, kv_heads, block_size, dim] (or dim + 4 int8 elements, `kv_quant`);
    block_tables: int32 [rows, max_blocks]; seq_lens: int32 [rows], the context each row
    attends to (its own new token included). `window`: each row sees only its last `window`
    positions, its own included; `softcap`: scores soft-capped before the softmax."""
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if rows == 0:
        return out
    assert k_cache.stride(3) == 1 and q.stride(2) == 1 and out.stride(2) == 1
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_decode[(rows, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale,
        window if window is not None else 1 << 30, softcap or 1.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(MIN_TILE, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_PAD=max(MIN_TILE, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE=max(TILE_TOKENS, block_size), PRECISION=precision,
        INT8=k_cache.dtype == torch.int8, SOFTCAP=softcap is not None,
    )
    return out
