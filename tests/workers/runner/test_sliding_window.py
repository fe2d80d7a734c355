"""Sliding windows and soft-capping in every attention path, against a dense reference.

The reference (`reference_attention`) is a masked softmax over the whole context in float64:
a query at position i sees positions j with i - window < j <= i (HF's `sliding_window`).
Contexts are shorter than, equal to and past the window, for decode rows and prefill chunks
(at 0, straddling the window's edge, starting past it, longer than it), with GQA groups and
several block sizes.
"""

from __future__ import annotations

import pytest
import torch

from tests.devices import DEVICES, TRITON_DEVICES, on_cuda
from workers.runner.attention import (
    build_metadata,
    first_visible,
    paged_attention,
    reference_attention,
    write_kv,
)

CPU = torch.device("cpu")

# (start, q_len): decodes of contexts 3, 8, 9, 13, 40 and prefill chunks at 0 (shorter than,
# equal to and longer than a window of 8), straddling its edge, past it, longer than it
DECODES = [(2, 1), (7, 1), (8, 1), (12, 1), (39, 1)]
CHUNKS = [(0, 5), (0, 8), (0, 21), (5, 10), (30, 6), (12, 20)]


def build(seqs, *, num_heads=6, num_kv_heads=2, head_dim=8, block=4, dtype=torch.float32,
          seed=0):
    """seqs: (start_pos, q_len) in the runner's order (decodes by context first). Blocks are
    handed out shuffled so tables are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(s + n) // block) for s, n in seqs) + 4
    k_cache = torch.randn(blocks, num_kv_heads, block, head_dim, generator=g)
    v_cache = torch.randn(blocks, num_kv_heads, block, head_dim, generator=g)
    free = torch.randperm(blocks, generator=g).tolist()
    batch = [(start, q_len, [free.pop() for _ in range(-(-(start + q_len) // block))])
             for start, q_len in seqs]
    tokens = sum(q_len for _, q_len, _ in batch)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=g) * 2
               for h in (num_heads, num_kv_heads, num_kv_heads))
    return [t.to(dtype) for t in (q, k, v, k_cache, v_cache)], batch


def layout(batch):
    rows, q_start = [], 0
    for start, q_len, table in batch:
        rows.append((q_start, q_len, start, table))
        q_start += q_len
    return rows


def run(tensors, batch, *, block=4, window=None, softcap=None, decode="torch",
        prefill="masked", device=CPU):
    q, k, v, k_cache, v_cache = (t.to(device) for t in tensors)
    group = q.shape[1] // k_cache.shape[1]
    meta = build_metadata(batch, block, k_cache.shape[1], group, device, q.dtype,
                          decode_kernel=None if decode == "torch" else decode,
                          prefill_kernel=prefill)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5, block,
                          window=window, softcap=softcap)
    ref = reference_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), layout(batch), block,
                              q.shape[-1] ** -0.5, window=window, softcap=softcap)
    return out.cpu(), ref


def test_first_visible_matches_transformers_sliding_window():
    """HF's mask keeps key j for query i where j > i - window (and j <= i)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    mask = sliding_window_causal_mask_function(3)
    for i in range(8):
        seen = [j for j in range(8) if mask(0, 0, torch.tensor(i), torch.tensor(j))]
        assert seen == list(range(first_visible(i, 3), i + 1))
    assert first_visible(2, None) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 5, 8, 12, 100])
def test_torch_paths_honour_the_window(window, device):
    """Decode groups and masked chunks, with GQA groups of 3, 1 and 8 and blocks of 4, 16."""
    for block, (num_heads, num_kv_heads) in [(4, (6, 2)), (16, (4, 4)), (4, (8, 1))]:
        tensors, batch = build(DECODES + CHUNKS, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, block=block)
        out, ref = run(tensors, batch, block=block, window=window, device=torch.device(device))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 8])
def test_torch_paths_soft_cap(window, device):
    device = torch.device(device)
    tensors, batch = build(DECODES + CHUNKS)
    out, ref = run(tensors, batch, window=window, softcap=3.0, device=device)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain, _ = run(tensors, batch, window=window, device=device)
    assert not torch.allclose(out, plain, atol=1e-3)  # the cap did something


def kernel_params(decode, prefill):
    """Shapes the kernels take: heads of 64 for the C prefill kernels, bfloat16 for AMX."""
    head_dim = 64 if prefill in ("vec", "amx") else 16
    dtype = torch.bfloat16 if prefill == "amx" else torch.float32
    return head_dim, dtype


def skip_unless_runs(decode, prefill):
    from workers.runner import amx_prefill, cpu_decode, vec_prefill

    if decode == "cpu" and not cpu_decode.available():
        pytest.skip("the C decode kernel does not build here")
    if prefill == "vec" and not vec_prefill.fits(torch.float32, 64, CPU):
        pytest.skip("no AVX-512 or AVX2 for the vector prefill kernel")
    if prefill == "amx" and not amx_prefill.fits(torch.bfloat16, 64, CPU):
        pytest.skip("no AMX here")


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("window", [1, 8, 13])
@pytest.mark.parametrize(("decode", "prefill"), [("cpu", "flash"), ("cpu", "vec"),
                                                 ("cpu", "amx"), ("torch", "flash")])
def test_kernel_paths_honour_window_and_softcap(decode, prefill, window, softcap):
    skip_unless_runs(decode, prefill)
    head_dim, dtype = kernel_params(decode, prefill)
    for block, (heads, kv_heads) in [(4, (6, 2)), (16, (8, 1))]:
        tensors, batch = build(DECODES + CHUNKS, num_heads=heads, num_kv_heads=kv_heads,
                               head_dim=head_dim, block=block, dtype=dtype)
        out, ref = run(tensors, batch, block=block, window=window, softcap=softcap,
                       decode=decode, prefill=prefill)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("pool", ["float32", "bfloat16", "int8"])
def test_cpu_decode_kernel_window_and_softcap_on_every_build_and_pool(pool):
    """Each build target (AVX-512 with its grouped blocks, AVX2, the portable loops) and pool
    type: the walk starts mid-block at len - window, and soft-capped scores."""
    from tests.workers.runner.conftest import build_targets
    from workers.runner import cpu_decode
    from workers.runner.kv_quant import quantize_rows

    skip_unless_runs("cpu", "masked")
    dtype = torch.bfloat16 if pool == "bfloat16" else torch.float32
    for head_dim, (heads, kv_heads), block in [(64, (8, 2), 16), (24, (6, 1), 4)]:
        tensors, batch = build(DECODES, num_heads=heads, num_kv_heads=kv_heads,
                               head_dim=head_dim, block=block, dtype=dtype)
        q, _, _, k_cache, v_cache = tensors
        if pool == "int8":
            k_cache, v_cache = (quantize_rows(c.view(-1, head_dim)).view(*c.shape[:3], -1)
                                for c in (k_cache, v_cache))
        tables = torch.zeros(len(batch), max(len(t) for *_, t in batch), dtype=torch.int32)
        for r, (*_, table) in enumerate(batch):
            tables[r, : len(table)] = torch.tensor(table)
        lens = torch.tensor([s + 1 for s, *_ in batch], dtype=torch.int32)
        scale = head_dim**-0.5
        for window, softcap in [(1, None), (5, None), (16, 2.0), (None, 2.0)]:
            ref = reference_attention(q, k_cache, v_cache, layout(batch), block, scale,
                                      window=window, softcap=softcap)
            for march in build_targets():
                for plain in (False, True) if march == "native" else (False,):
                    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, scale,
                                                  block, window=window, softcap=softcap,
                                                  plain=plain, march=march)
                    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
                    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (8, 2.5)])
def test_triton_decode_kernel_honours_window_and_softcap(window, softcap, device):
    """In Triton's interpreter on CPU (tiny: it is slow), on the GPU where there is one."""
    device = torch.device(device)
    tensors, batch = build(DECODES, num_heads=4, num_kv_heads=2, head_dim=16, block=4)
    out, ref = run(tensors, batch, window=window, softcap=softcap, decode="triton",
                   device=device)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def dense_chunk(q, k_new, v_new, k_ctx, v_ctx, scale, window):
    """A chunk after `context` keys, as a masked softmax in float64: query i at position
    context + i sees keys j with context + i - window < j <= context + i."""
    k = torch.cat([k_ctx.transpose(0, 1), k_new]).double()  # [keys, kv_heads, dim]
    v = torch.cat([v_ctx.transpose(0, 1), v_new]).double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos = torch.arange(q.shape[0])[:, None] + k_ctx.shape[1]
    keys = torch.arange(k.shape[0])[None, :]
    visible = (keys <= pos) & (keys > pos - window)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vec_and_amx_prefill_kernels_take_a_window_on_each_build(dtype):
    """Windows shorter than a task's queries (1, 7), across a span (40, 70), past the whole
    context (200); contexts of 0 and 30 before a 50-query chunk."""
    from tests.workers.runner.conftest import build_targets
    from workers.runner import amx_prefill, vec_prefill

    g = torch.Generator().manual_seed(3)
    marches = [m for m in build_targets() if m != "x86-64"]
    for context in (0, 30):
        q = torch.randn(50, 4, 64, generator=g).to(dtype)
        k_new, v_new = (torch.randn(50, 2, 64, generator=g).to(dtype) for _ in range(2))
        k_ctx, v_ctx = (torch.randn(2, context, 64, generator=g).to(dtype) for _ in range(2))
        for window in (1, 7, 40, 70, 200):
            ref = dense_chunk(q, k_new, v_new, k_ctx, v_ctx, 0.125, window)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            outs = [vec_prefill.prefill_attention(q, k_new, v_new, k_ctx, v_ctx, 0.125,
                                                  window=window, march=m)
                    for m in marches if vec_prefill.fits(dtype, 64, CPU)]
            if dtype == torch.bfloat16 and amx_prefill.fits(dtype, 64, CPU):
                outs.append(amx_prefill.prefill_attention(q, k_new, v_new, k_ctx, v_ctx, 0.125,
                                                          window=window))
            for out in outs:
                torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_split_with_a_window(dtype):
    """Runs of `window` queries, each with its own keys, the range all of them see and the
    reversed triangle: windows of 1, odd sizes, equal to the chunk, one short of the whole;
    contexts of 0, shorter than and longer than the window; GQA groups of 3."""
    from workers.runner import flash_prefill

    if not flash_prefill.fits(CPU):
        pytest.skip("no fused CPU attention kernel in this torch")
    g = torch.Generator().manual_seed(5)
    for context, q_len, window in [(0, 20, 1), (0, 20, 7), (5, 20, 7), (40, 33, 9),
                                   (40, 33, 33), (3, 30, 32), (100, 17, 64), (10, 64, 16)]:
        q = torch.randn(q_len, 6, 16, generator=g).to(dtype)
        k_new, v_new = (torch.randn(q_len, 2, 16, generator=g).to(dtype) for _ in range(2))
        k_ctx, v_ctx = (torch.randn(2, context, 16, generator=g).to(dtype) for _ in range(2))
        out = flash_prefill.cached_chunk_attention(q, k_ctx, v_ctx, k_new, v_new, 0.25,
                                                   window=window)
        ref = dense_chunk(q, k_new, v_new, k_ctx, v_ctx, 0.25, window)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(("decode", "prefill", "device"), [
    pytest.param("torch", "masked", "cpu", id="torch-masked"),
    pytest.param("cpu", "flash", "cpu", id="cpu-flash"),
    pytest.param("cpu", "vec", "cpu", id="cpu-vec"),
    pytest.param("cpu", "amx", "cpu", id="cpu-amx"),
    *(pytest.param("triton", "masked", *p.values, id=f"triton-masked-{p.id}", marks=p.marks)
      for p in TRITON_DEVICES),
    on_cuda("torch", "masked", "cuda", id="torch-masked-cuda"),
])
def test_blocks_wholly_before_the_window_are_never_read(decode, prefill, device):
    """Those blocks are filled with NaN after the reference is taken, and their table entries
    are `RELEASED` (-1), as the block manager leaves them when it gives them back: any read
    of them (even at weight 0) would show in the output, or fail."""
    from workers.engine.block_manager import RELEASED

    skip_unless_runs(decode, prefill)
    head_dim, dtype = kernel_params(decode, prefill)
    window, block = 6, 4
    seqs = [(s, n) for s, n in DECODES + CHUNKS if decode != "triton" or n == 1]
    tensors, batch = build(seqs, head_dim=head_dim, block=block, dtype=dtype)
    device = torch.device(device)
    q, k, v, k_cache, v_cache = (t.to(device) for t in tensors)
    released = [(start, n, [RELEASED if i < first_visible(start, window) // block else b
                            for i, b in enumerate(table)]) for start, n, table in batch]
    meta = build_metadata(released, block, 2, 3, device, dtype,
                          decode_kernel=None if decode == "torch" else decode,
                          prefill_kernel=prefill)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    scale = head_dim**-0.5
    ref = reference_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), layout(batch), block,
                              scale, window=window)
    poisoned = 0
    for (_, _, table), (_, _, kept) in zip(batch, released, strict=True):
        for b, entry in zip(table, kept, strict=True):
            if entry == RELEASED:
                k_cache[b], v_cache[b] = float("nan"), float("nan")
                poisoned += 1
    assert poisoned > 5
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale, block, window=window).cpu()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_a_layer_variant_is_built_once_a_step_and_only_where_the_window_cuts():
    _, batch = build(DECODES + CHUNKS)
    meta = build_metadata(batch, 4, 2, 3, CPU, prefill_kernel="flash")
    assert meta.for_layer(None, None) is meta
    assert meta.for_layer(41, None) is meta  # longer than every context: nothing to cut
    windowed = meta.for_layer(8, None)
    assert windowed is meta.for_layer(8, None) and windowed.window == 8
    capped = meta.for_layer(None, 30.0)
    assert capped is not windowed and capped.prefill_kernel == "masked"
    # rows x heads x blocks: the row of context 40 needs blocks 8-9 only (positions 32-39),
    # the widest is context 13's, blocks 1-3 (positions 5-12): 3 blocks a row, not 10
    assert meta.for_layer(None, 30.0).decode_groups[0].pieces.numel() == 5 * 2 * 10
    assert windowed.decode_groups[0].pieces.numel() == 5 * 2 * 3
    # the chunk at 30 gathers its context from block 5 (position 23 is its first visible)
    chunk = windowed.prefills[4]
    assert (chunk.cached, chunk.pieces.numel()) == (30 - 20, 3 * 2)
    with pytest.raises(ValueError, match="at least 1"):
        meta.for_layer(0, None)


def test_the_pool_window_is_the_widest_where_every_layer_has_one():
    from workers.runner.attention import pool_window

    assert pool_window([4096] * 4) == 4096
    assert pool_window([512, 1024]) == 1024
    assert pool_window([512, None, 512]) is None  # Gemma: global layers read everything
    assert pool_window([]) is None
