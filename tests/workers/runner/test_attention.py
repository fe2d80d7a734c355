"""Batched paged attention against the per-head float32 reference, on a scattered pool."""

from __future__ import annotations

import pytest
import torch

from workers.runner.attention import (
    AttentionMetadata,
    PrefillChunk,
    causal_mask,
    paged_attention,
    reference_attention,
    write_kv,
)

BLOCK = 4


def build(seqs, num_heads=6, num_kv_heads=2, head_dim=8, num_blocks=32, seed=0):
    """seqs: (start_pos, q_len). Blocks are handed out shuffled so tables are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks * BLOCK, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks * BLOCK, num_kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] != 1)  # decodes first
    tables, layout, slots, q_start = {}, [], [], 0
    for i in order:
        start, q_len = seqs[i]
        ctx = start + q_len
        tables[i] = [free.pop() for _ in range(-(-ctx // BLOCK))]
        layout.append((q_start, q_len, start, tables[i]))
        slots += [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, ctx)]
        q_start += q_len
    q = torch.randn(q_start, num_heads, head_dim, generator=g)
    k_new = torch.randn(q_start, num_kv_heads, head_dim, generator=g)
    v_new = torch.randn(q_start, num_kv_heads, head_dim, generator=g)
    write_kv(k_cache, v_cache, k_new, v_new, torch.tensor(slots))
    return q, k_cache, v_cache, layout, torch.tensor(slots), num_heads // num_kv_heads


def metadata(layout, slot_mapping, group) -> AttentionMetadata:
    decodes = [entry for entry in layout if entry[1] == 1]
    meta = AttentionMetadata(slot_mapping, len(decodes), None, None, [])
    if decodes:
        max_len = max(start + 1 for _, _, start, _ in decodes)
        slots = torch.zeros(len(decodes), max_len, dtype=torch.long)
        mask = torch.zeros(len(decodes), 1, 1, max_len, dtype=torch.bool)
        for i, (_, _, start, table) in enumerate(decodes):
            for p in range(start + 1):
                slots[i, p] = table[p // BLOCK] * BLOCK + p % BLOCK
            mask[i, ..., : start + 1] = True
        meta.decode_slots, meta.decode_mask = slots, mask
    for q_start, q_len, start, table in layout:
        if q_len == 1:
            continue
        kv = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start + q_len)])
        meta.prefills.append(
            PrefillChunk(q_start, q_len, start, kv, causal_mask(start, q_len, group, kv.device))
        )
    return meta


@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param([(0, 9)], id="one-prompt"),
        pytest.param([(5, 1), (17, 1), (0, 1)], id="decodes"),
        pytest.param([(12, 1), (0, 7), (30, 1), (6, 5), (3, 1)], id="mixed-chunked"),
    ],
)
def test_batched_attention_equals_reference(seqs):
    q, k_cache, v_cache, layout, slot_mapping, group = build(seqs)
    scale = 8**-0.5
    out = paged_attention(q, k_cache, v_cache, metadata(layout, slot_mapping, group), scale)
    ref = reference_attention(q, k_cache, v_cache, layout, BLOCK, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_kv_written_at_the_slot_of_each_position():
    k_cache = torch.zeros(8 * BLOCK, 1, 2)
    v_cache = torch.zeros(8 * BLOCK, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([21, 22, 5]))
    assert k_cache[21].tolist() == [[0.0, 1.0]]
    assert k_cache[5].tolist() == [[4.0, 5.0]]
    assert v_cache[22].tolist() == [[-2.0, -3.0]]
    assert torch.nonzero(k_cache.abs().sum(dim=(1, 2))).flatten().tolist() == [5, 21, 22]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_attention_close_to_reference():
    q, k_cache, v_cache, layout, slot_mapping, group = build([(12, 1), (0, 7), (6, 5)])
    meta = metadata(layout, slot_mapping, group)
    dev = torch.device("cuda")
    meta.slot_mapping = meta.slot_mapping.to(dev)
    meta.decode_slots = meta.decode_slots.to(dev)
    meta.decode_mask = meta.decode_mask.to(dev)
    for chunk in meta.prefills:
        chunk.kv_slots, chunk.mask = chunk.kv_slots.to(dev), chunk.mask.to(dev)
    scale = 8**-0.5
    out = paged_attention(
        q.to(dev, torch.bfloat16), k_cache.to(dev, torch.bfloat16),
        v_cache.to(dev, torch.bfloat16), meta, scale,
    )
    ref = reference_attention(q, k_cache, v_cache, layout, BLOCK, scale)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
