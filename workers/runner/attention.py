"""Attention over the paged KV pool for one flattened batch.

The pool of a layer is `[num_blocks, num_kv_heads, block_size, head_dim]` for K and for V: a
block holds each head's tokens contiguously. A token's slot is
`block_table[pos // block_size] * block_size + pos % block_size`; in the flat `[rows, head_dim]`
view, its row for KV head h is `(block * num_kv_heads + h) * block_size + pos % block_size`.
Gathering (block, head) pieces in (sequence, head, block) order gives `[seqs, heads, context,
dim]` contiguous, the layout SDPA reads fastest, in one `index_select`.

- Decode rows (one query token each) come first in the batch. The torch backend serves them
  in groups of similar context length, so little padding is read: each group gathers whole
  blocks of its sequences into one padded tensor and makes one SDPA call. The kernel backends
  serve them all with one call that reads the pool in place: `triton` on CUDA
  (`triton_decode`), `cpu` on CPU (`cpu_decode`, a C kernel).
- A prefill chunk that starts at position 0 attends only to its own fresh K/V: causal SDPA,
  nothing read from the pool. A later chunk gathers its cached context. With the `flash`
  prefill kernel (the default on CPU) it attends to that context and to its own K/V in two
  fused calls merged by log-sum-exp (`flash_prefill`); with `masked` (the fallback) it gathers
  its own positions too and hands SDPA an explicit causal mask. The `amx` and `vec` kernels
  (`amx_prefill`, `vec_prefill`) take every chunk whole, its context and its own K/V, in one
  call.

Grouped-query attention folds the query heads of a KV head into the query length, so K and V
are never repeated.

An int8 pool (`kv_cache_dtype: int8`, `kv_quant`) has rows of head_dim int8 values and their
float32 scale: writes quantize each new row, gathers dequantize what they gathered (into a
reused buffer) before SDPA, and the C decode kernel reads the int8 rows in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.runner import amx_prefill, vec_prefill
from workers.runner.flash_prefill import cached_chunk_attention
from workers.runner.kv_quant import dequantize_rows, head_dim_of, is_quantized, quantize_rows


@dataclass
class DecodeGroup:
    """Decode rows [row_start, row_start + num_rows) with their padded block tables."""

    row_start: int
    num_rows: int
    pieces: torch.Tensor  # [num_rows * kv_heads * max_blocks] (block, head) pieces to gather
    mask: torch.Tensor  # [num_rows, 1, 1, max_blocks * block_size], 0 = attend, -inf = not


@dataclass
class DecodeBatch:
    """All decode rows [0, num_rows) for an in-place kernel: int32 tables and lengths."""

    kernel: str  # "triton" | "cpu"
    num_rows: int
    block_tables: torch.Tensor  # [num_rows, max_blocks], padded with block 0
    seq_lens: torch.Tensor  # [num_rows], context including the new token


@dataclass
class PrefillChunk:
    """A run of query rows of one sequence: rows [q_start, q_start + q_len).

    A chunk at 0 reads nothing from the pool (`pieces` None). A later one reads the pieces of
    its context: with a `mask` (the masked kernel) every position up to its last token, else
    (the flash kernel) only the `cached` positions before it.
    """

    q_start: int
    q_len: int
    pieces: torch.Tensor | None  # [kv_heads * blocks] of the context; None for a chunk at 0
    mask: torch.Tensor | None  # masked kernel only: [group * q_len, context] additive
    cached: int = 0  # the chunk's start position: context tokens computed before it


class GatherWorkspace:
    """Two buffers (K and V) that every gather of a runner writes into, grown on demand.

    A gathered context is megabytes; a fresh tensor per call is fresh pages from the OS on
    CPU, and faulting them in cost as much as the copy itself (a decode step's attention ran
    about 2x faster with reused buffers). Each gather is consumed by SDPA before the next one.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def gather(self, name: str, cache: torch.Tensor, pieces: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """`cache`'s (block, head) `pieces` as `[pieces * block_size, dim]`; an int8 pool's
        rows are dequantized to `dtype` (into a second buffer)."""
        _, _, block_size, row = cache.shape
        out = self._buffer(name, pieces.numel(), block_size * row, cache.dtype, cache.device)
        torch.index_select(cache.view(-1, block_size * row), 0, pieces, out=out)
        if not is_quantized(cache):
            return out.view(-1, row)
        head_dim = head_dim_of(cache)
        dense = self._buffer(f"{name}.dequantized", pieces.numel(), block_size * head_dim,
                             dtype or torch.float32, cache.device)
        rows = out.view(-1, row)
        return dequantize_rows(rows, dense.dtype, out=dense.view(-1, head_dim))

    def _buffer(self, name: str, n: int, width: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1] != width or buf.dtype != dtype:
            buf = torch.empty(max(n, 0 if buf is None else 2 * buf.shape[0]), width,
                              dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:n]


@dataclass
class AttentionMetadata:
    write_rows: torch.Tensor  # [num_tokens * kv_heads] each new token's rows in the flat pool
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    decode_batch: DecodeBatch | None = None
    workspace: GatherWorkspace | None = None  # None: a fresh one for this call
    prefill_kernel: str = "masked"  # `amx`, `vec`: every prefill chunk through one C kernel


# How prefill chunks after cached context are served (attention_backend.pick_prefill_attention).
PREFILL_KERNELS = ("flash", "masked", "amx", "vec")
# The kernels that take every chunk whole, cached context or not, in one call.
_CHUNK_KERNELS = {"amx": amx_prefill.prefill_attention, "vec": vec_prefill.prefill_attention}

# Decode rows are grouped by context length; a group never holds more rows than this, so
# short contexts are not padded to the longest one in the batch.
DECODE_GROUP_ROWS = 16


def build_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, num_kv_heads: int, group: int,
    device: torch.device, dtype: torch.dtype = torch.float32, *, decode_kernel: str | None = None,
    prefill_kernel: str = "masked", workspace: GatherWorkspace | None = None,
) -> AttentionMetadata:
    """seqs: (start_pos, q_len, block_table) in batch order, decodes (q_len 1) first, sorted
    by context length. Index tensors are built on the CPU and moved once. With a
    `decode_kernel` ("triton" or "cpu"), decode rows get one `DecodeBatch` for it instead of
    SDPA groups. `prefill_kernel` ("flash" or "masked") serves chunks after cached context.

    Masks are additive (0 / -inf) in the model dtype: SDPA is faster with them than with
    boolean masks on CPU.
    """
    bs = block_size
    slots: list[int] = []
    for start, q_len, table in seqs:
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + q_len))
    num_decodes = sum(1 for _, q_len, _ in seqs if q_len == 1)
    decodes = seqs[:num_decodes]
    decode_batch = None
    if decode_kernel and decodes:
        decode_batch = _decode_batch(decode_kernel, decodes, bs, device)
    groups = []
    for first in range(0, 0 if decode_kernel else num_decodes, DECODE_GROUP_ROWS):
        rows = decodes[first : first + DECODE_GROUP_ROWS]
        lens = [start + 1 for start, _, _ in rows]
        width = -(-max(lens) // bs)
        padded = _padded_tables(rows, width, torch.long)
        visible = torch.arange(width * bs).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        groups.append(
            DecodeGroup(
                row_start=first,
                num_rows=len(rows),
                pieces=_pieces(padded, num_kv_heads).to(device, non_blocking=True),
                mask=_additive(visible[:, None, None, :], dtype).to(device, non_blocking=True),
            )
        )
    if prefill_kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill_kernel must be one of {', '.join(PREFILL_KERNELS)}")
    prefills, q_start = [], num_decodes
    for start, q_len, table in seqs[num_decodes:]:
        if start == 0:
            prefills.append(PrefillChunk(q_start, q_len, pieces=None, mask=None))
        elif prefill_kernel in ("flash", *_CHUNK_KERNELS):
            blocks = torch.tensor([table[: -(-start // bs)]], dtype=torch.long)
            pieces = _pieces(blocks, num_kv_heads).to(device, non_blocking=True)
            prefills.append(PrefillChunk(q_start, q_len, pieces, mask=None, cached=start))
        else:
            blocks = torch.tensor([table[: -(-(start + q_len) // bs)]], dtype=torch.long)
            pieces = _pieces(blocks, num_kv_heads).to(device, non_blocking=True)
            visible = causal_mask(start, q_len, group, torch.device("cpu"))
            mask = _additive(visible, dtype).to(device, non_blocking=True)
            prefills.append(PrefillChunk(q_start, q_len, pieces, mask, cached=start))
        q_start += q_len
    slot = torch.tensor(slots, dtype=torch.long)
    write_rows = ((slot // bs * num_kv_heads * bs + slot % bs)[:, None]
                  + torch.arange(num_kv_heads) * bs).flatten()
    return AttentionMetadata(
        write_rows=write_rows.to(device, non_blocking=True),
        decode_groups=groups,
        prefills=prefills,
        decode_batch=decode_batch,
        workspace=workspace,
        prefill_kernel=prefill_kernel,
    )


def _decode_batch(
    kernel: str, decodes: list[tuple[int, int, list[int]]], block_size: int,
    device: torch.device,
) -> DecodeBatch:
    lens = [start + 1 for start, _, _ in decodes]
    tables = _padded_tables(decodes, -(-max(lens) // block_size), torch.int32)
    return DecodeBatch(
        kernel=kernel,
        num_rows=len(decodes),
        block_tables=tables.to(device, non_blocking=True),
        seq_lens=torch.tensor(lens, dtype=torch.int32).to(device, non_blocking=True),
    )


def _padded_tables(
    rows: list[tuple[int, int, list[int]]], width: int, dtype: torch.dtype,
) -> torch.Tensor:
    """The first `width` blocks of each row's table, padded with block 0 (masked out)."""
    padded = torch.zeros(len(rows), width, dtype=dtype)
    for r, (_, _, table) in enumerate(rows):
        used = table[:width]
        padded[r, : len(used)] = torch.tensor(used, dtype=dtype)
    return padded


def _pieces(tables: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[rows, blocks] tables -> (block, head) piece ids in (row, head, block) order."""
    heads = torch.arange(num_kv_heads).view(1, num_kv_heads, 1)
    return (tables.unsqueeze(1) * num_kv_heads + heads).flatten()


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible.cpu(), float("-inf"))


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    write_rows: torch.Tensor,
) -> None:
    """k, v: [tokens, kv_heads, dim], written at `AttentionMetadata.write_rows` (quantized
    first for an int8 pool, `kv_quant`)."""
    head_dim, row = k.shape[-1], k_cache.shape[-1]
    k, v = k.reshape(-1, head_dim), v.reshape(-1, head_dim)
    if is_quantized(k_cache):
        k, v = quantize_rows(k), quantize_rows(v)
    k_cache.view(-1, row).index_copy_(0, write_rows, k)
    v_cache.view(-1, row).index_copy_(0, write_rows, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: this step's [tokens, kv_heads, dim], already pooled."""
    parts = []
    if meta.decode_batch is not None:
        batch = meta.decode_batch
        kernel = _decode_kernel(batch.kernel)
        parts.append(kernel(q[: batch.num_rows], k_cache, v_cache, batch.block_tables,
                            batch.seq_lens, scale, block_size))
    workspace = meta.workspace or GatherWorkspace()

    def gather(name: str, cache: torch.Tensor, pieces: torch.Tensor) -> torch.Tensor:
        return workspace.gather(name, cache, pieces, q.dtype)

    for group in meta.decode_groups:
        rows = slice(group.row_start, group.row_start + group.num_rows)
        k_ctx, v_ctx = gather("k", k_cache, group.pieces), gather("v", v_cache, group.pieces)
        parts.append(_decode(q[rows], k_ctx, v_ctx, group, scale))
    whole = _CHUNK_KERNELS.get(meta.prefill_kernel)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        if chunk.pieces is None:
            parts.append(whole(q[rows], k[rows], v[rows], None, None, scale) if whole
                         else _prefill_fresh(q[rows], k[rows], v[rows], scale))
            continue
        ctx_k, ctx_v = gather("k", k_cache, chunk.pieces), gather("v", v_cache, chunk.pieces)
        if chunk.mask is None:  # flash: the cached context only; the chunk's K/V are fresh
            kv_heads, head_dim = k_cache.shape[1], q.shape[-1]
            ctx_k = ctx_k.view(kv_heads, -1, head_dim)[:, : chunk.cached]
            ctx_v = ctx_v.view(kv_heads, -1, head_dim)[:, : chunk.cached]
            parts.append(whole(q[rows], k[rows], v[rows], ctx_k, ctx_v, scale) if whole
                         else cached_chunk_attention(q[rows], ctx_k, ctx_v, k[rows], v[rows],
                                                     scale))
        else:
            parts.append(_prefill_cached(q[rows], ctx_k, ctx_v, chunk.mask, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode_kernel(name: str) -> Callable[..., torch.Tensor]:
    """Imported on first use: Triton is only imported where it runs."""
    if name == "triton":
        from workers.runner.triton_decode import paged_decode
    else:
        from workers.runner.cpu_decode import paged_decode
    return paged_decode


def _decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, scale: float,
) -> torch.Tensor:
    """k, v: the group's gathered pieces, [rows * kv_heads * blocks * block_size, dim]."""
    batch, num_heads, head_dim = q.shape
    context = group.mask.shape[-1]  # the padded width: whole blocks
    k = k.view(batch, -1, context, head_dim)
    v = v.view(batch, -1, context, head_dim)
    num_kv_heads = k.shape[1]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)
    return o.reshape(batch, num_heads, head_dim)


def _prefill_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def causal_mask(start_pos: int, q_len: int, group: int, device: torch.device) -> torch.Tensor:
    """Query i (position start_pos + i) sees positions <= its own; tiled for each group row."""
    ctx = start_pos + q_len
    query_pos = torch.arange(start_pos, ctx, device=device)
    mask = torch.arange(ctx, device=device)[None, :] <= query_pos[:, None]
    return mask.repeat(group, 1)


def _prefill_cached(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    """k, v: the gathered context, [kv_heads * whole blocks, dim]; the mask cuts it short."""
    q_len, num_heads, head_dim = q.shape
    group, context = mask.shape[0] // q_len, mask.shape[-1]
    num_kv_heads = num_heads // group
    k = k.view(num_kv_heads, -1, head_dim)[:, :context]
    v = v.view(num_kv_heads, -1, head_dim)[:, :context]
    # [q_len, kvh*group, d] -> [kvh, group*q_len, d]: row r of a group is query r % q_len.
    qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * q_len, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return o.reshape(q_len, num_heads, head_dim)


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    seqs: list[tuple[int, int, int, list[int]]], block_size: int, scale: float,
) -> torch.Tensor:
    """Plain per-sequence, per-head softmax attention in float32: the yardstick for tests.

    `seqs` holds (q_start, q_len, start_pos, block_table) for each sequence of the batch.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for q_start, q_len, start_pos, block_table in seqs:
        ctx = start_pos + q_len
        # [ctx, kv_heads, dim], one position at a time: no shortcut shared with the fast path
        k = torch.stack([k_cache[block_table[p // block_size], :, p % block_size]
                         for p in range(ctx)]).float()
        v = torch.stack([v_cache[block_table[p // block_size], :, p % block_size]
                         for p in range(ctx)]).float()
        for i in range(q_len):
            visible = start_pos + i + 1
            for h in range(q.shape[1]):
                kv_head = h // group
                scores = (k[:visible, kv_head] @ q[q_start + i, h].float()) * scale
                weights = torch.softmax(scores, dim=0)
                out[q_start + i, h] = (weights @ v[:visible, kv_head]).to(q.dtype)
    return out
