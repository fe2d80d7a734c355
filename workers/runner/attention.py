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
  fused calls merged by log-sum-exp (`flash_prefill`); with `causal` (the default on CUDA) it
  gathers its own positions too and SDPA takes a lower-right causal bias, which CUDA serves
  with its flash or memory-efficient kernel without a mask; with `masked` (the fallback) it
  gathers the same and hands SDPA an explicit causal mask. The `amx` and `vec` kernels
  (`amx_prefill`, `vec_prefill`) take every chunk whole, its context and its own K/V, in one
  call.

Grouped-query attention folds the query heads of a KV head into the query length, so K and V
are never repeated.

Sliding windows (Mistral, Gemma 2 and 3, gpt-oss), soft-capped scores (Gemma 2) and attention
sinks (gpt-oss) are arguments of `paged_attention`, per layer, on the one metadata of the step:
a layer whose window cuts some context gets a variant of it (`AttentionMetadata.for_layer`,
built once a step) whose gathers start at the block of each query's first visible position, so
blocks wholly before the window are never read. The decode kernels start their walk at
len - window, the vec and AMX prefill kernels mask per query, the flash split takes the window
in runs (`flash_prefill`), and the masked path cuts its mask. Soft-capping is done by both
decode kernels and by the torch paths; a soft-capped layer's prefill chunks take `masked`
(`_prefill_kernel_for`). Sinks (a learned logit per head that joins each query's softmax
denominator and takes no value) are done by the C decode kernel and the torch paths: a sink
layer's prefill chunks take `masked`, and on CUDA its decode rows take the torch groups, the
Triton kernel having no sink term (it cannot be tested without a GPU here;
`_decode_kernel_takes`).

An int8 pool (`kv_cache_dtype: int8`, `kv_quant`) has rows of head_dim int8 values and their
float32 scale: writes quantize each new row, gathers dequantize what they gathered (into a
reused buffer) before SDPA, and the C decode kernel reads the int8 rows in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

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
class _Batch:
    """What `build_metadata` was given: a layer with a sliding window or soft-capping gets its
    own metadata from it (`AttentionMetadata.for_layer`)."""

    seqs: Sequence[tuple[int, int, list[int]]]
    block_size: int
    num_kv_heads: int
    group: int
    device: torch.device
    dtype: torch.dtype
    num_decodes: int
    longest: int  # the longest context in the batch, its own tokens included


@dataclass
class AttentionMetadata:
    write_rows: torch.Tensor  # [num_tokens * kv_heads] each new token's rows in the flat pool
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    decode_batch: DecodeBatch | None = None
    workspace: GatherWorkspace | None = None  # None: a fresh one for this call
    prefill_kernel: str = "masked"  # `amx`, `vec`: every prefill chunk through one C kernel
    batch: _Batch | None = None
    # (window, soft-capped, sinks) -> the metadata of layers that attend that way, built once
    # a step
    variants: dict[tuple[int | None, bool, bool], AttentionMetadata] = field(
        default_factory=dict)
    window: int | None = None  # the window this metadata's pieces and masks were cut to

    def for_layer(self, window: int | None, softcap: float | None,
                  sinks: bool = False) -> AttentionMetadata:
        """The metadata of a layer that attends within `window` positions, soft-caps its
        scores and/or has attention sinks: itself where none changes anything for this batch
        (no context passes the window), else a variant built once per step and shared by
        every such layer.

        A variant reads fewer blocks: decode groups and prefill chunks gather only the blocks
        that hold a position some query of theirs sees, and their masks are cut to the
        window. The decode kernels take `window` and `softcap` themselves. The rule for
        soft-capping is here and only here: the fused prefill kernels (`flash`, `vec`,
        `amx`) do not soft-cap, so a soft-capped layer's prefill chunks take `masked`; the
        same for sinks.
        """
        if window is None and softcap is None and not sinks:
            return self
        batch = self.batch
        if batch is None:
            raise ValueError("a sliding window, soft-capping or sinks need metadata from "
                             "build_metadata")
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must be at least 1 position, not {window}")
        if window is not None and window >= batch.longest:
            window = None  # every query already sees its whole context
        key = (window, softcap is not None, sinks)
        if key == (None, False, False):
            return self
        variant = self.variants.get(key)
        if variant is None:
            kernel = _prefill_kernel_for(self.prefill_kernel, window, softcap, sinks)
            decodes = batch.seqs[: batch.num_decodes]
            decode_batch, groups = self.decode_batch, self.decode_groups
            if decode_batch is not None and not _decode_kernel_takes(decode_batch.kernel,
                                                                     window, softcap, sinks):
                if batch.longest == UNBOUNDED:  # fixed tables (a graph): no rows to group
                    raise ValueError(f"decode kernel {decode_batch.kernel!r} cannot serve "
                                     "this layer inside a captured graph")
                decode_batch, groups = None, _decode_groups(decodes, batch, window)
            elif decode_batch is None and window is not None:
                groups = _decode_groups(decodes, batch, window)
            prefills = self.prefills
            explicit = softcap is not None or sinks  # scores written out, not one SDPA call
            if window is not None or explicit or kernel != self.prefill_kernel:
                prefills = _prefill_chunks(batch.seqs[batch.num_decodes:], batch.num_decodes,
                                           batch, kernel, window, explicit)
            variant = AttentionMetadata(
                write_rows=self.write_rows, decode_groups=groups, prefills=prefills,
                decode_batch=decode_batch, workspace=self.workspace, prefill_kernel=kernel,
                batch=batch, window=window)
            self.variants[key] = variant
        return variant


# How prefill chunks after cached context are served (attention_backend.pick_prefill_attention).
PREFILL_KERNELS = ("flash", "masked", "amx", "vec", "causal")
# The kernels that take every chunk whole, cached context or not, in one call.
_CHUNK_KERNELS = {"amx": amx_prefill.prefill_attention, "vec": vec_prefill.prefill_attention}


def _prefill_kernel_for(kernel: str, window: int | None, softcap: float | None,
                        sinks: bool = False) -> str:
    """Which prefill kernel serves a layer with this window, soft-capping and sinks: the one
    place that routes a layer away from a kernel that cannot serve it. Every kernel but
    `causal` takes a window (a causal bias has no window: such layers take `masked` where the
    window binds); no fused prefill kernel soft-caps or has a sink term, so soft-capped and
    sink layers take `masked`."""
    if softcap is not None or sinks or (kernel == "causal" and window is not None):
        return "masked"
    return kernel


def _decode_kernel_takes(kernel: str, window: int | None, softcap: float | None,
                         sinks: bool = False) -> bool:
    """Whether an in-place decode kernel serves a layer with this window, soft-capping and
    sinks (else its decode rows take the torch groups): both kernels take windows and
    soft-capping; only the C kernel (`cpu`) takes sinks. The Triton kernel has no sink term
    (it cannot be tested without a GPU here), so on CUDA a sink layer's decode rows take the
    torch groups."""
    if sinks:
        return kernel == "cpu"
    return kernel in ("cpu", "triton")

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

    This is the metadata of layers that see their whole context; a layer with a sliding
    window or soft-capping asks it for its own (`AttentionMetadata.for_layer`).

    Masks are additive (0 / -inf) in the model dtype: SDPA is faster with them than with
    boolean masks on CPU.
    """
    bs = block_size
    if prefill_kernel not in PREFILL_KERNELS:
        raise ValueError(f"prefill_kernel must be one of {', '.join(PREFILL_KERNELS)}")
    slots: list[int] = []
    for start, q_len, table in seqs:
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + q_len))
    num_decodes = sum(1 for _, q_len, _ in seqs if q_len == 1)
    batch = _Batch(seqs, bs, num_kv_heads, group, device, dtype, num_decodes,
                   max((start + q_len for start, q_len, _ in seqs), default=0))
    decodes = seqs[:num_decodes]
    decode_batch = None
    if decode_kernel and decodes:
        decode_batch = _decode_batch(decode_kernel, decodes, bs, device)
    groups = [] if decode_kernel else _decode_groups(decodes, batch, None)
    prefills = _prefill_chunks(seqs[num_decodes:], num_decodes, batch, prefill_kernel, None,
                               False)
    write_rows = slot_rows(torch.tensor(slots, dtype=torch.long), bs, num_kv_heads)
    return AttentionMetadata(
        write_rows=write_rows.to(device, non_blocking=True),
        decode_groups=groups,
        prefills=prefills,
        decode_batch=decode_batch,
        workspace=workspace,
        prefill_kernel=prefill_kernel,
        batch=batch,
    )


def slot_rows(slots: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Token slots (`block * block_size + offset`) -> their rows in the flat pool, one per KV
    head, token-major: `AttentionMetadata.write_rows`. Tensor ops only, on the slots' device
    (a captured graph computes them from its slot buffer)."""
    bs = block_size
    heads = torch.arange(num_kv_heads, device=slots.device) * bs
    return ((slots // bs * num_kv_heads * bs + slots % bs)[:, None] + heads).flatten()


# What a captured batch's longest context counts as: every length may come by a later replay.
UNBOUNDED = 1 << 62


def fixed_decode_metadata(
    kernel: str, write_rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    block_size: int, num_kv_heads: int, group: int, device: torch.device, dtype: torch.dtype,
) -> AttentionMetadata:
    """Metadata of decode rows over fixed-size tensors (a CUDA graph's persistent buffers,
    `cuda_graphs`) for an in-place decode `kernel`: nothing in it depends on the values
    those tensors hold, so each replay reads what they hold then. A layer's variant
    (`for_layer`) keeps the same tensors, and its window is always handed to the kernel:
    `longest` is unbounded, since a later replay's contexts may pass the window."""
    batch = _Batch([], block_size, num_kv_heads, group, device, dtype, num_decodes=0,
                   longest=UNBOUNDED)
    return AttentionMetadata(
        write_rows=write_rows, decode_groups=[], prefills=[],
        decode_batch=DecodeBatch(kernel, seq_lens.shape[0], block_tables, seq_lens),
        batch=batch)


def first_visible(pos: int, window: int | None) -> int:
    """The first position a query at `pos` attends to: HF's sliding window keeps key j for
    query i where `j > i - window` (transformers' `sliding_window_overlay`), so a window of
    w is the w most recent positions, the query's own included."""
    return 0 if window is None else max(0, pos - window + 1)


def pool_window(windows: Iterable[int | None]) -> int | None:
    """The window by which a sequence's old blocks may be given back (`BlockManager(window=)`):
    the widest of the layers' windows where every layer has one (Mistral), else None (some
    layer reads whole contexts: Gemma 2 and 3's global layers; or no layer is given)."""
    windows = list(windows)
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def _decode_groups(
    decodes: Sequence[tuple[int, int, list[int]]], batch: _Batch, window: int | None,
) -> list[DecodeGroup]:
    """SDPA groups of decode rows; with a window each row's table starts at the block of its
    first visible position, so blocks wholly before the window are not gathered."""
    bs = batch.block_size
    groups = []
    for first in range(0, len(decodes), DECODE_GROUP_ROWS):
        rows = decodes[first : first + DECODE_GROUP_ROWS]
        lens = [start + 1 for start, _, _ in rows]
        skip = [first_visible(start, window) // bs for start, _, _ in rows]  # blocks not read
        width = max(-(-n // bs) - s for n, s in zip(lens, skip, strict=True))
        padded = _padded_tables([(0, 0, table[s:]) for (_, _, table), s
                                 in zip(rows, skip, strict=True)], width, torch.long)
        ar = torch.arange(width * bs).unsqueeze(0)
        offset = torch.tensor(skip).unsqueeze(1) * bs
        visible = ar < torch.tensor(lens).unsqueeze(1) - offset
        if window is not None:
            visible &= ar >= torch.tensor(lens).unsqueeze(1) - window - offset
        groups.append(
            DecodeGroup(
                row_start=first,
                num_rows=len(rows),
                pieces=_pieces(padded, batch.num_kv_heads).to(batch.device, non_blocking=True),
                mask=_additive(visible[:, None, None, :], batch.dtype).to(batch.device,
                                                                           non_blocking=True),
            )
        )
    return groups


def _prefill_chunks(
    chunks: Sequence[tuple[int, int, list[int]]], q_start: int, batch: _Batch, kernel: str,
    window: int | None, explicit: bool,
) -> list[PrefillChunk]:
    """The prefill chunks' pieces (and masks, for `masked`). With a window, a chunk's gather
    starts at the block of its first query's first visible position, and `cached` counts the
    gathered positions before the chunk (not all of them). A `masked` chunk at 0 runs on its
    own K/V with no mask, unless the window cuts it or its scores are written out (`explicit`:
    soft-capped, or with sinks), which one causal SDPA call cannot do."""
    bs, num_kv_heads, device = batch.block_size, batch.num_kv_heads, batch.device
    prefills = []
    for start, q_len, table in chunks:
        skip = first_visible(start, window) // bs  # whole blocks before the window
        base = skip * bs
        if kernel == "causal":  # no window here (`_prefill_kernel_for`)
            pieces = None
            if start:  # the pool holds the chunk's own K/V too: gather through its last
                blocks = torch.tensor([table[: -(-(start + q_len) // bs)]], dtype=torch.long)
                pieces = _pieces(blocks, num_kv_heads).to(device, non_blocking=True)
            prefills.append(PrefillChunk(q_start, q_len, pieces, mask=None, cached=start))
        elif kernel != "masked":
            if start == 0:
                prefills.append(PrefillChunk(q_start, q_len, pieces=None, mask=None))
            else:
                blocks = torch.tensor([table[skip : -(-start // bs)]], dtype=torch.long)
                pieces = _pieces(blocks, num_kv_heads).to(device, non_blocking=True)
                prefills.append(PrefillChunk(q_start, q_len, pieces, mask=None,
                                             cached=start - base))
        elif start == 0 and (window is None or q_len <= window) and not explicit:
            prefills.append(PrefillChunk(q_start, q_len, pieces=None, mask=None))
        else:  # the pool holds the chunk's own K/V too: gather through its last position
            blocks = torch.tensor([table[skip : -(-(start + q_len) // bs)]], dtype=torch.long)
            pieces = _pieces(blocks, num_kv_heads).to(device, non_blocking=True)
            visible = causal_mask(start, q_len, batch.group, torch.device("cpu"),
                                  window=window, key_start=base)
            mask = _additive(visible, batch.dtype).to(device, non_blocking=True)
            prefills.append(PrefillChunk(q_start, q_len, pieces, mask, cached=start - base))
        q_start += q_len
    return prefills


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
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, dim]; k, v: this step's [tokens, kv_heads, dim], already pooled.

    `window`: a sliding window, HF's `sliding_window` (Mistral, Gemma 2 and 3): a query at
    position i attends to positions j with `i - window < j <= i`, the `window` most recent
    positions its own included (`first_visible`); None attends to the whole context.
    `softcap`: attention logit soft-capping (Gemma 2), `scores = tanh(scores / softcap) *
    softcap` on the scaled scores before the softmax; None leaves them as they are.
    `sinks`: [heads] attention sinks (gpt-oss), one logit per head that joins every query's
    softmax denominator and adds no value: weights `exp(s_j) / (exp(sink) + sum_j exp(s_j))`.
    Every path honours all three, or `AttentionMetadata.for_layer` routes the layer to one
    that does.
    """
    meta = meta.for_layer(window, softcap, sinks is not None)
    window = meta.window  # None where no context of this batch passes the window
    parts = []
    if meta.decode_batch is not None:
        batch = meta.decode_batch
        kernel = _decode_kernel(batch.kernel)
        extra = {} if sinks is None else {"sinks": sinks}  # only the C kernel takes sinks
        parts.append(kernel(q[: batch.num_rows], k_cache, v_cache, batch.block_tables,
                            batch.seq_lens, scale, block_size, window=window, softcap=softcap,
                            **extra))
    workspace = meta.workspace or GatherWorkspace()

    def gather(name: str, cache: torch.Tensor, pieces: torch.Tensor) -> torch.Tensor:
        return workspace.gather(name, cache, pieces, q.dtype)

    for group in meta.decode_groups:
        rows = slice(group.row_start, group.row_start + group.num_rows)
        k_ctx, v_ctx = gather("k", k_cache, group.pieces), gather("v", v_cache, group.pieces)
        parts.append(_decode(q[rows], k_ctx, v_ctx, group, scale, softcap, sinks))
    whole = _CHUNK_KERNELS.get(meta.prefill_kernel)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        if chunk.pieces is None:
            if whole:
                parts.append(whole(q[rows], k[rows], v[rows], None, None, scale, window=window))
            elif window is not None and chunk.q_len > window:  # flash: the window cuts it
                empty = k.new_empty(k.shape[1], 0, k.shape[2])
                parts.append(cached_chunk_attention(q[rows], empty, empty, k[rows], v[rows],
                                                    scale, window=window))
            else:
                parts.append(_prefill_fresh(q[rows], k[rows], v[rows], scale))
            continue
        ctx_k, ctx_v = gather("k", k_cache, chunk.pieces), gather("v", v_cache, chunk.pieces)
        if meta.prefill_kernel == "causal":
            parts.append(_prefill_causal(q[rows], ctx_k, ctx_v, k_cache.shape[1], chunk.cached,
                                         scale))
        elif chunk.mask is None:  # flash: the cached context only; the chunk's K/V are fresh
            kv_heads, head_dim = k_cache.shape[1], q.shape[-1]
            ctx_k = ctx_k.view(kv_heads, -1, head_dim)[:, : chunk.cached]
            ctx_v = ctx_v.view(kv_heads, -1, head_dim)[:, : chunk.cached]
            parts.append(whole(q[rows], k[rows], v[rows], ctx_k, ctx_v, scale, window=window)
                         if whole
                         else cached_chunk_attention(q[rows], ctx_k, ctx_v, k[rows], v[rows],
                                                     scale, window=window))
        else:
            parts.append(_prefill_cached(q[rows], ctx_k, ctx_v, chunk.mask, scale, softcap,
                                         sinks))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode_kernel(name: str) -> Callable[..., torch.Tensor]:
    """Imported on first use: Triton is only imported where it runs."""
    if name == "triton":
        from workers.runner.triton_decode import paged_decode
    else:
        from workers.runner.cpu_decode import paged_decode
    return paged_decode


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float, softcap: float | None, sink: torch.Tensor | None = None
            ) -> torch.Tensor:
    """SDPA with an additive mask; with soft-capping or a sink, the same written out (SDPA
    has no hook between the scores and the softmax), in float32. `sink`: each query row's
    sink logit, shaped like the scores with one column; it joins the softmax and is dropped
    from the weights."""
    if softcap is None and sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2))
    if softcap is None:
        scores = scores.mul_(scale).add_(mask)
    else:
        scores = scores.mul_(scale / softcap).tanh_().mul_(softcap).add_(mask)
    if sink is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        columns = scores.shape[-1]
        sink = sink.float().expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :columns]
    return torch.matmul(weights, v.float()).to(q.dtype)


def _decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """k, v: the group's gathered pieces, [rows * kv_heads * blocks * block_size, dim]."""
    batch, num_heads, head_dim = q.shape
    context = group.mask.shape[-1]  # the padded width: whole blocks
    k = k.view(batch, -1, context, head_dim)
    v = v.view(batch, -1, context, head_dim)
    num_kv_heads = k.shape[1]
    group_size = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group_size, head_dim)
    # query head kv * group + g is row g of KV head kv
    sink = None if sinks is None else sinks.view(1, num_kv_heads, group_size, 1)
    o = _attend(qg, k, v, group.mask, scale, softcap, sink)
    return o.reshape(batch, num_heads, head_dim)


def _prefill_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def _prefill_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int,
                    cached: int, scale: float) -> torch.Tensor:
    """A chunk after `cached` positions: k, v are its gathered context through its own last
    position, `[kv_heads * whole blocks, dim]`. SDPA with a lower-right causal bias (query i
    sees keys up to cached + i): on CUDA one flash or memory-efficient kernel call with no
    mask in memory; elsewhere SDPA's math path, which builds the mask itself. K/V heads are
    repeated for grouped queries: the bias's fused calls take equal head counts."""
    q_len, num_heads, head_dim = q.shape
    keys = cached + q_len
    k = k.view(num_kv_heads, -1, head_dim)[:, :keys]
    v = v.view(num_kv_heads, -1, head_dim)[:, :keys]
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                       v.unsqueeze(0), attn_mask=causal_lower_right(q_len, keys),
                                       scale=scale)
    return o[0].transpose(0, 1)


def causal_mask(start_pos: int, q_len: int, group: int, device: torch.device, *,
                window: int | None = None, key_start: int = 0) -> torch.Tensor:
    """Query i (position start_pos + i) sees positions <= its own (and, with a `window`,
    greater than its own - window); keys are positions key_start .. start_pos + q_len - 1.
    Tiled for each group row."""
    ctx = start_pos + q_len
    query_pos = torch.arange(start_pos, ctx, device=device)[:, None]
    key_pos = torch.arange(key_start, ctx, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask.repeat(group, 1)


def _prefill_cached(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
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
    sink = None
    if sinks is not None:  # row g * q_len + i of KV head kv is query head kv * group + g
        sink = sinks.view(num_kv_heads, group, 1).repeat_interleave(q_len, dim=1)
    o = _attend(qg, k, v, mask, scale, softcap, sink)
    o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return o.reshape(q_len, num_heads, head_dim)


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    seqs: list[tuple[int, int, int, list[int]]], block_size: int, scale: float, *,
    window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain per-sequence, per-head softmax attention in float64: the yardstick for tests.

    `seqs` holds (q_start, q_len, start_pos, block_table) for each sequence of the batch;
    `window`, `softcap` and `sinks` as `paged_attention` takes them, applied to the whole
    context (a sink: one more logit in each head's softmax, whose weight is thrown away).
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for q_start, q_len, start_pos, block_table in seqs:
        ctx = start_pos + q_len
        # [ctx, kv_heads, dim], one position at a time: no shortcut shared with the fast path
        k = torch.stack([dequantized(k_cache[block_table[p // block_size], :, p % block_size])
                         for p in range(ctx)]).double()
        v = torch.stack([dequantized(v_cache[block_table[p // block_size], :, p % block_size])
                         for p in range(ctx)]).double()
        k = k.repeat_interleave(group, dim=1)  # [ctx, heads, dim]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start : q_start + q_len].double(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(start_pos, ctx)[:, None]  # each query's position
        keys = torch.arange(ctx)[None, :]
        visible = keys <= pos
        if window is not None:
            visible &= keys > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
            weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :ctx]
        else:
            weights = torch.softmax(scores, dim=-1)
        out[q_start : q_start + q_len] = torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)
    return out


def dequantized(rows: torch.Tensor) -> torch.Tensor:
    """Pool rows as floats: int8 rows (`kv_quant`) dequantized, others as they are."""
    return dequantize_rows(rows, torch.float32) if is_quantized(rows) else rows
