"""Attention over the paged KV pool for one flattened batch.

The pool of a layer is `[num_blocks * block_size, num_kv_heads, head_dim]`; a token's slot is
`block_table[pos // block_size] * block_size + pos % block_size`. Decode rows come first in
the batch and are served together: their context slots are gathered into one padded tensor
and handled by one SDPA call. Each prefill chunk is one SDPA call over its own context.
Grouped-query attention is done by folding the query heads of a KV head into the query
length, so K and V are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """A run of query rows of one sequence: rows [q_start, q_start + q_len)."""

    q_start: int
    q_len: int
    start_pos: int
    kv_slots: torch.Tensor  # slots of positions [0, start_pos + q_len)
    mask: torch.Tensor  # [group * q_len, start_pos + q_len], True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] padded with slot 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] True = attend
    prefills: list[PrefillChunk]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    num_kv_heads = k_cache.shape[1]
    if meta.num_decodes:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        out[: meta.num_decodes] = _decode(
            q[: meta.num_decodes], k_cache, v_cache, meta.decode_slots, meta.decode_mask, scale
        )
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        k = k_cache[chunk.kv_slots]
        v = v_cache[chunk.kv_slots]
        out[rows] = _prefill(q[rows], k, v, chunk.mask, num_kv_heads, scale)
    return out


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor, mask: torch.Tensor, scale: float,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    k = k_cache[slots].transpose(1, 2)  # [B, kvh, L, d]
    v = v_cache[slots].transpose(1, 2)
    qg = q.view(batch, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(batch, num_heads, head_dim)


def causal_mask(start_pos: int, q_len: int, group: int, device: torch.device) -> torch.Tensor:
    """Query i (position start_pos + i) sees positions <= its own; tiled for each group row."""
    ctx = start_pos + q_len
    query_pos = torch.arange(start_pos, ctx, device=device)
    mask = torch.arange(ctx, device=device)[None, :] <= query_pos[:, None]
    return mask.repeat(group, 1)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    num_kv_heads: int, scale: float,
) -> torch.Tensor:
    q_len, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    # [q_len, kvh*group, d] -> [kvh, group*q_len, d]: row r of a group is query r % q_len.
    qg = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * q_len, head_dim)
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)  # [kvh, L, d]
    o = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask, scale=scale)
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
        slots = [block_table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        k = k_cache[slots].float()
        v = v_cache[slots].float()
        for i in range(q_len):
            visible = start_pos + i + 1
            for h in range(q.shape[1]):
                kv_head = h // group
                scores = (k[:visible, kv_head] @ q[q_start + i, h].float()) * scale
                weights = torch.softmax(scores, dim=0)
                out[q_start + i, h] = (weights @ v[:visible, kv_head]).to(q.dtype)
    return out
