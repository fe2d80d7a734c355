"""Batched paged attention against the per-head float32 reference, on a scattered pool."""

from __future__ import annotations

import pytest
import torch

from tests.devices import TRITON_DEVICES, on_cuda
from workers.runner.attention import (
    GatherWorkspace,
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
    k_cache = torch.randn(num_blocks, num_kv_heads, BLOCK, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, num_kv_heads, BLOCK, head_dim, generator=g)
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
    meta = build_metadata(batch, BLOCK, k_cache.shape[1], group, device, q.dtype,
                          decode_kernel=None if backend == "torch" else backend)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    return paged_attention(q, k, v, k_cache, v_cache, meta, 8**-0.5, BLOCK)


# (backend, device): the torch path and the C kernel ("cpu") on CPU tensors; Triton in its
# interpreter on CPU tensors where there is no GPU, else on CUDA; the torch path on CUDA too.
BACKENDS = [
    pytest.param("torch", "cpu", id="torch"),
    pytest.param("cpu", "cpu", id="cpu"),
    *(pytest.param("triton", *p.values, id=f"triton-{p.id}", marks=p.marks)
      for p in TRITON_DEVICES),
    on_cuda("torch", "cuda", id="torch-cuda"),
]


def on_backend_device(backend, device, q, k, v, k_cache, v_cache, batch, group):
    """Run `run` where the backend runs (float32 either way) and bring the result back."""
    device = torch.device(device)
    tensors = (t.to(device) for t in (q, k, v, k_cache, v_cache))
    return run(*tensors, batch, group, device, backend=backend).cpu()


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
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
def test_batched_attention_equals_reference(seqs, backend, device):
    q, k, v, k_cache, v_cache, batch, group = build(seqs)
    out = on_backend_device(backend, device, q, k, v, k_cache, v_cache, batch, group)
    meta = build_metadata(batch, BLOCK, k_cache.shape[1], group, CPU)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    ref = reference_attention(q, k_cache, v_cache, layout(batch), BLOCK, 8**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_one_workspace_serves_every_gather_of_a_step_and_the_next():
    """Three decode groups and two cached prefill chunks all gather into the same two buffers:
    each gather must be consumed before the next overwrites it."""
    seqs = [(i * 5 % 61, 1) for i in range(40)] + [(6, 5), (30, 9)]
    q, k, v, k_cache, v_cache, batch, group = build(seqs)
    workspace = GatherWorkspace()
    meta = build_metadata(batch, BLOCK, k_cache.shape[1], group, CPU, workspace=workspace)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    ref = reference_attention(q, k_cache, v_cache, layout(batch), BLOCK, 8**-0.5)
    for _ in range(2):
        out = paged_attention(q, k, v, k_cache, v_cache, meta, 8**-0.5, BLOCK)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_rows_are_grouped_by_length():
    seqs = [(i, 1) for i in range(40)]
    _, _, _, _, _, batch, group = build(seqs)
    meta = build_metadata(batch, BLOCK, 2, group, torch.device("cpu"))
    assert [(g.row_start, g.num_rows) for g in meta.decode_groups] == [(0, 16), (16, 16), (32, 8)]
    assert [g.mask.shape[-1] // BLOCK for g in meta.decode_groups] == [4, 8, 10]
    # one (block, head) piece per row, KV head and block: 16 x 2 x 4, 16 x 2 x 8, 8 x 2 x 10
    assert [g.pieces.numel() for g in meta.decode_groups] == [128, 256, 160]


def test_pieces_are_gathered_in_row_head_block_order():
    batch = [(5, 1, [7, 3]), (2, 1, [4])]  # sorted by context: the runner's order
    batch.sort(key=lambda s: s[0])
    meta = build_metadata(batch, BLOCK, 2, 1, CPU)
    # piece id = block * kv_heads + head; row 0 (block 4) is padded to 2 blocks with block 0
    assert meta.decode_groups[0].pieces.tolist() == [8, 0, 9, 1, 14, 6, 15, 7]


def test_decode_kernel_gets_one_padded_int32_table():
    batch = [(4, 1, [7, 3]), (9, 1, [5, 1, 8, 2]), (0, 3, [6])]
    meta = build_metadata(batch, BLOCK, 1, 2, CPU, decode_kernel="cpu")
    assert meta.decode_groups == []
    assert meta.decode_batch is not None and meta.decode_batch.num_rows == 2
    assert meta.decode_batch.kernel == "cpu"
    # context 5 needs 2 blocks, context 10 needs 3: the unused 4th block of row 1 is cut
    assert meta.decode_batch.block_tables.tolist() == [[7, 3, 0], [5, 1, 8]]
    assert meta.decode_batch.block_tables.dtype == torch.int32
    assert meta.decode_batch.seq_lens.tolist() == [5, 10]
    assert [(p.q_start, p.q_len) for p in meta.prefills] == [(2, 3)]


@pytest.mark.parametrize(("backend", "device"), [p for p in BACKENDS if p.values[0] != "torch"])
def test_decode_kernel_head_dim_and_group_need_no_power_of_two(backend, device):
    q, k, v, k_cache, v_cache, batch, _ = build(
        [(i * 7 % 50, 1) for i in range(6)], num_heads=6, num_kv_heads=1, head_dim=24)
    out = on_backend_device(backend, device, q, k, v, k_cache, v_cache, batch, 6)
    meta = build_metadata(batch, BLOCK, k_cache.shape[1], 6, CPU)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    ref = reference_attention(q, k_cache, v_cache, layout(batch), BLOCK, 8**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_kv_written_at_the_slot_of_each_position():
    k_cache = torch.zeros(8, 2, BLOCK, 3)  # [blocks, kv heads, block size, dim]
    v_cache = torch.zeros(8, 2, BLOCK, 3)
    # positions 3, 4, 5 of a sequence on blocks [6, 2]: block 6 offset 3, block 2 offsets 0, 1
    meta = build_metadata([(3, 3, [6, 2])], BLOCK, 2, 1, CPU)
    k = torch.arange(1.0, 19.0).view(3, 2, 3)
    write_kv(k_cache, v_cache, k, -k, meta.write_rows)
    for token, (block, offset) in enumerate([(6, 3), (2, 0), (2, 1)]):
        for head in range(2):
            assert k_cache[block, head, offset].tolist() == k[token, head].tolist()
            assert v_cache[block, head, offset].tolist() == (-k[token, head]).tolist()
    assert int(torch.count_nonzero(k_cache)) == k.numel()


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_bfloat16_attention_close_to_reference(backend):
    q, k, v, k_cache, v_cache, batch, group = build([(12, 1), (40, 1), (0, 7), (6, 5)])
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    meta = build_metadata(batch, BLOCK, k_cache.shape[1], group, torch.device("cpu"))
    write_kv(ref_k, ref_v, k, v, meta.write_rows)
    ref = reference_attention(q, ref_k, ref_v, layout(batch), BLOCK, 8**-0.5)
    out = run(*(t.to(dev, bf16) for t in (q, k, v, k_cache, v_cache)), batch, group, dev,
              backend=backend)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)


def run_prefill(q, k, v, k_cache, v_cache, batch, group, kernel, head_dim=8):
    meta = build_metadata(batch, BLOCK, k_cache.shape[1], group, CPU, q.dtype,
                          decode_kernel="cpu", prefill_kernel=kernel)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    return paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5, BLOCK), meta


PREFILL_BATCHES = [
    pytest.param([(9, 6)], id="one-chunk-after-context"),
    pytest.param([(4, 4), (13, 2), (0, 5), (30, 11)], id="several-chunks-one-batch"),
    pytest.param([(7, 1), (21, 1), (3, 9), (0, 3), (40, 17)], id="with-decodes"),
    pytest.param([(3, 2), (5, 30)], id="context-in-a-partial-block"),
]


@pytest.mark.parametrize("seqs", PREFILL_BATCHES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (3, 3), (8, 1)])
def test_flash_prefill_equals_reference_and_masked(seqs, num_heads, num_kv_heads):
    """Chunks after cached context: the flash split against the per-head reference and the
    masked path, with grouped-query heads (group 3, none, 8) and several sequences per batch."""
    q, k, v, k_cache, v_cache, batch, group = build(seqs, num_heads, num_kv_heads)
    flash, meta = run_prefill(q, k, v, k_cache.clone(), v_cache.clone(), batch, group, "flash")
    masked, _ = run_prefill(q, k, v, k_cache.clone(), v_cache.clone(), batch, group, "masked")
    assert all(p.mask is None for p in meta.prefills)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    ref = reference_attention(q, k_cache, v_cache, layout(batch), BLOCK, 8**-0.5)
    torch.testing.assert_close(flash, ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(flash, masked, rtol=1e-5, atol=1e-5)


def test_flash_prefill_reads_only_the_cached_blocks_and_builds_no_mask():
    # context 9 = blocks 0-2 of the table (the last one partly), the chunk's 6 tokens follow
    batch = [(9, 6, [5, 8, 2, 7])]
    flash = build_metadata(batch, BLOCK, 2, 3, CPU, prefill_kernel="flash").prefills[0]
    assert (flash.cached, flash.mask) == (9, None)
    assert flash.pieces.tolist() == [10, 16, 4, 11, 17, 5]  # (block * 2 + head), head-major
    masked = build_metadata(batch, BLOCK, 2, 3, CPU, prefill_kernel="masked").prefills[0]
    assert masked.mask.shape == (3 * 6, 15) and masked.pieces.numel() == 2 * 4


def test_unknown_prefill_kernel_is_refused():
    with pytest.raises(ValueError, match="prefill_kernel must be one of flash, masked"):
        build_metadata([(4, 3, [1, 2])], BLOCK, 2, 1, CPU, prefill_kernel="math")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_prefill_in_half_precision_is_close_to_the_float32_reference(dtype):
    q, k, v, k_cache, v_cache, batch, group = build([(4, 4), (30, 11)])
    half = (t.to(dtype) for t in (q, k, v, k_cache, v_cache))
    out, meta = run_prefill(*half, batch, group, "flash")
    assert out.dtype == dtype
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    ref = reference_attention(q, k_cache, v_cache, layout(batch), BLOCK, 8**-0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_flash_prefill_of_a_long_context_stays_exact():
    """Hundreds of cached positions: a merge that mis-weighs the two halves shows here."""
    q, k, v, k_cache, v_cache, batch, group = build([(397, 23), (0, 16)], head_dim=16)
    out, meta = run_prefill(q, k, v, k_cache.clone(), v_cache.clone(), batch, group, "flash",
                            head_dim=16)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    ref = reference_attention(q, k_cache, v_cache, layout(batch), BLOCK, 16**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def cuda_prefill_kernels(dtype: torch.dtype, head_dim: int) -> list[str]:
    """Every prefill kernel the runner accepts on CUDA (`masked` today; a fused one when the
    runner gains it)."""
    from workers.runner.attention import PREFILL_KERNELS
    from workers.runner.attention_backend import pick_prefill_attention

    kernels = []
    for name in PREFILL_KERNELS:
        try:
            pick_prefill_attention(name, torch.device("cuda"), dtype=dtype, head_dim=head_dim)
        except ValueError:
            continue
        kernels.append(name)
    return kernels


@pytest.mark.cuda
@pytest.mark.parametrize("seqs", [*PREFILL_BATCHES, pytest.param([(0, 40), (0, 3)],
                                                                 id="fresh-prompts")])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (3, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_on_cuda_equals_reference(seqs, num_heads, num_kv_heads, dtype):
    """Prompt chunks at 0 and after cached context on CUDA, through each prefill kernel the
    runner can pick there, with decode rows in the batch on the Triton kernel."""
    cuda = torch.device("cuda")
    q, k, v, k_cache, v_cache, batch, group = build(seqs, num_heads, num_kv_heads)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    meta = build_metadata(batch, BLOCK, num_kv_heads, group, CPU)
    write_kv(ref_k, ref_v, k, v, meta.write_rows)
    ref = reference_attention(q, ref_k, ref_v, layout(batch), BLOCK, 8**-0.5)
    kernels = cuda_prefill_kernels(dtype, 8)
    assert "masked" in kernels
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for kernel in kernels:
        qd, kd, vd, kc, vc = (t.to(cuda, dtype) for t in (q, k, v, k_cache, v_cache))
        meta = build_metadata(batch, BLOCK, num_kv_heads, group, cuda, dtype,
                              decode_kernel="triton", prefill_kernel=kernel)
        write_kv(kc, vc, kd, vd, meta.write_rows)
        out = paged_attention(qd, kd, vd, kc, vc, meta, 8**-0.5, BLOCK)
        assert out.dtype == dtype and out.device.type == "cuda"
        torch.testing.assert_close(out.float().cpu(), ref, rtol=tol, atol=tol, msg=kernel)
