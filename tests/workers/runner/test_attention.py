"""Batched paged attention against the per-head float32 reference, on a scattered pool."""

from __future__ import annotations

import pytest
import torch

from workers.runner.attention import (
    build_metadata,
    paged_attention,
    reference_attention,
    write_kv,
)

BLOCK = 4


def build(seqs, num_heads=6, num_kv_heads=2, head_dim=8, num_blocks=512, seed=0):
    """seqs: (start_pos, q_len). Blocks are handed out shuffled so tables are not contiguous.

    Returns the batch in the runner's order: decodes by context length, then prefills.
    """
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks * BLOCK, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks * BLOCK, num_kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    ordered = sorted(seqs, key=lambda s: (s[1] != 1, s[0] if s[1] == 1 else 0))
    batch = [(start, q_len, [free.pop() for _ in range(-(-(start + q_len) // BLOCK))])
             for start, q_len in ordered]
    tokens = sum(q_len for _, q_len, _ in batch)
    q = torch.randn(tokens, num_heads, head_dim, generator=g)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=g)
    return q, k, v, k_cache, v_cache, batch, num_heads // num_kv_heads


def layout(batch):
    """(q_start, q_len, start_pos, table) rows for the reference."""
    rows, q_start = [], 0
    for start, q_len, table in batch:
        rows.append((q_start, q_len, start, table))
        q_start += q_len
    return rows


CPU = torch.device("cpu")


def run(q, k, v, k_cache, v_cache, batch, group, device=CPU, backend="torch"):
    meta = build_metadata(batch, BLOCK, group, device, q.dtype,
                          decode_kernel=backend == "triton")
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return paged_attention(q, k, v, k_cache, v_cache, meta, 8**-0.5, BLOCK)


BACKENDS = ["torch", "triton"]  # triton: Triton's interpreter on CPU, the kernel on CUDA


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "seqs",
    [
        pytest.param([(0, 9)], id="one-prompt"),
        pytest.param([(5, 1), (17, 1), (0, 1)], id="decodes"),
        pytest.param([(12, 1), (0, 7), (30, 1), (6, 5), (3, 1)], id="mixed-chunked"),
        pytest.param([(i * 3 % 41, 1) for i in range(40)] + [(0, 4)], id="many-decode-groups"),
        pytest.param([(200, 1), (0, 1), (63, 1), (64, 1), (3, 6)], id="long-and-tile-edges"),
    ],
)
def test_batched_attention_equals_reference(seqs, backend):
    q, k, v, k_cache, v_cache, batch, group = build(seqs)
    out = run(q, k, v, k_cache, v_cache, batch, group, backend=backend)
    ref = reference_attention(q, k_cache, v_cache, layout(batch), BLOCK, 8**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_rows_are_grouped_by_length():
    seqs = [(i, 1) for i in range(40)]
    _, _, _, _, _, batch, group = build(seqs)
    meta = build_metadata(batch, BLOCK, group, torch.device("cpu"))
    assert [(g.row_start, g.num_rows) for g in meta.decode_groups] == [(0, 16), (16, 16), (32, 8)]
    assert [g.mask.shape[-1] // BLOCK for g in meta.decode_groups] == [4, 8, 10]
    assert [g.block_tables.numel() for g in meta.decode_groups] == [64, 128, 80]


def test_decode_kernel_gets_one_padded_int32_table():
    batch = [(4, 1, [7, 3]), (9, 1, [5, 1, 8, 2]), (0, 3, [6])]
    meta = build_metadata(batch, BLOCK, 2, CPU, decode_kernel=True)
    assert meta.decode_groups == []
    assert meta.decode_batch is not None and meta.decode_batch.num_rows == 2
    # context 5 needs 2 blocks, context 10 needs 3: the unused 4th block of row 1 is cut
    assert meta.decode_batch.block_tables.tolist() == [[7, 3, 0], [5, 1, 8]]
    assert meta.decode_batch.block_tables.dtype == torch.int32
    assert meta.decode_batch.seq_lens.tolist() == [5, 10]
    assert [(p.q_start, p.q_len) for p in meta.prefills] == [(2, 3)]


def test_decode_kernel_head_dim_and_group_need_no_power_of_two():
    q, k, v, k_cache, v_cache, batch, _ = build(
        [(i * 7 % 50, 1) for i in range(6)], num_heads=6, num_kv_heads=1, head_dim=24)
    out = run(q, k, v, k_cache, v_cache, batch, 6, backend="triton")
    ref = reference_attention(q, k_cache, v_cache, layout(batch), BLOCK, 8**-0.5)
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
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_bfloat16_attention_close_to_reference(backend):
    q, k, v, k_cache, v_cache, batch, group = build([(12, 1), (40, 1), (0, 7), (6, 5)])
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    meta = build_metadata(batch, BLOCK, group, torch.device("cpu"))
    write_kv(ref_k, ref_v, k, v, meta.slot_mapping)
    ref = reference_attention(q, ref_k, ref_v, layout(batch), BLOCK, 8**-0.5)
    out = run(*(t.to(dev, bf16) for t in (q, k, v, k_cache, v_cache)), batch, group, dev,
              backend=backend)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
