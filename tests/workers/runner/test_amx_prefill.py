"""The AMX prefill attention kernel against a float32 masked softmax: chunks with and without
cached context, lengths off every block size, grouped heads, q/k/v as strided views of one
fused projection (as the model hands them over); and the build for CPUs without AMX."""

from __future__ import annotations

import pytest
import torch

from workers.runner import amx_prefill, cpu_amx, flash_prefill

needs_amx = pytest.mark.skipif(not cpu_amx.available(),
                               reason="this CPU has no AMX bfloat16 (or Linux refused it)")
HEADS, KV_HEADS, DIM = 9, 3, 64


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [q_len, heads, dim]; k, v [kv_heads, start + q_len, dim]; float32 throughout."""
    q_len = q.shape[0]
    group = q.shape[1] // k.shape[0]
    kf = k.float().repeat_interleave(group, 0)
    vf = v.float().repeat_interleave(group, 0)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * DIM**-0.5
    hidden = torch.arange(k.shape[1])[None, :] > torch.arange(start, start + q_len)[:, None]
    return (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ vf).transpose(0, 1)


def operands(q_len: int, start: int, seed: int):
    """q, k_new, v_new as views of one fused projection; the context as a gathered pool."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(q_len, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).bfloat16()
    q = fused[:, : HEADS * DIM].view(q_len, HEADS, DIM)
    k_new = fused[:, HEADS * DIM: (HEADS + KV_HEADS) * DIM].view(q_len, KV_HEADS, DIM)
    v_new = fused[:, (HEADS + KV_HEADS) * DIM:].view(q_len, KV_HEADS, DIM)
    pool = torch.randn(2, KV_HEADS, start + 37, DIM, generator=gen).bfloat16()  # padded blocks
    k_ctx, v_ctx = pool[0, :, :start], pool[1, :, :start]
    k_all = torch.cat([k_ctx, k_new.transpose(0, 1)], dim=1)
    v_all = torch.cat([v_ctx, v_new.transpose(0, 1)], dim=1)
    return q, k_new, v_new, k_ctx, v_ctx, k_all, v_all


def test_a_build_without_amx_refuses():
    lib = amx_prefill.load_library("x86-64-v3")
    x = torch.zeros(16, dtype=torch.bfloat16)
    p = x.data_ptr()
    assert lib.amx_prefill_attention(p, 64, 64, p, p, 64, 64, p, p, 64, 64, p, 64, 64, 1, 0,
                                      1, 1, 1.0, 1) == -1


def test_fits_only_bfloat16_heads_of_64_on_cpu():
    cpu = torch.device("cpu")
    assert not amx_prefill.fits(torch.float32, 64, cpu)
    assert not amx_prefill.fits(torch.bfloat16, 128, cpu)
    assert amx_prefill.fits(torch.bfloat16, 64, cpu) == cpu_amx.available()


@needs_amx
@pytest.mark.parametrize(("q_len", "start"), [(1, 0), (5, 0), (16, 0), (17, 3), (40, 100),
                                              (130, 0), (100, 300), (1, 257), (300, 500)])
def test_matches_the_masked_softmax(q_len, start):
    q, k_new, v_new, k_ctx, v_ctx, k_all, v_all = operands(q_len, start, q_len + start)
    got = amx_prefill.prefill_attention(q, k_new, v_new, k_ctx if start else None,
                                        v_ctx if start else None, DIM**-0.5)
    # p is rounded to bfloat16 before it meets V, as in the PyTorch bfloat16 kernels
    torch.testing.assert_close(got.float(), reference(q, k_all, v_all, start), atol=1.5e-2,
                               rtol=2e-2)


@needs_amx
def test_agrees_with_the_flash_split_it_replaces():
    q, k_new, v_new, k_ctx, v_ctx, _, _ = operands(200, 333, 7)
    got = amx_prefill.prefill_attention(q, k_new, v_new, k_ctx, v_ctx, DIM**-0.5)
    flash = flash_prefill.cached_chunk_attention(q, k_ctx, v_ctx, k_new, v_new, DIM**-0.5)
    torch.testing.assert_close(got.float(), flash.float(), atol=1.5e-2, rtol=2e-2)
