"""The AMX prefill attention kernel against a float64 masked softmax: chunks with and without
cached context, lengths off every block size, grouped heads, q/k/v as strided views of one
fused projection (as the model hands them over); and the build for CPUs without AMX."""

from __future__ import annotations

import pytest
import torch

from tests.workers.runner.test_vec_prefill import operands, reference
from workers.runner import amx_prefill, cpu_amx, flash_prefill

needs_amx = pytest.mark.skipif(not cpu_amx.available(),
                               reason="this CPU has no AMX bfloat16 (or Linux refused it)")
DIM = 64
DIMS = amx_prefill.HEAD_DIMS


def test_a_build_without_amx_refuses():
    lib = amx_prefill.load_library("x86-64-v3")
    x = torch.zeros(16, dtype=torch.bfloat16)
    p = x.data_ptr()
    assert lib.amx_prefill_attention(p, 64, 64, p, p, 64, 64, p, p, 64, 64, p, 64, 64, 1, 0,
                                      1, 1, 64, 1.0, 1, 0) == -1


@needs_amx
def test_an_unserved_head_size_is_refused():
    lib = amx_prefill.load_library()
    x = torch.zeros(16, dtype=torch.bfloat16)
    p = x.data_ptr()
    assert lib.amx_prefill_attention(p, 96, 96, p, p, 96, 96, p, p, 96, 96, p, 96, 96, 1, 0,
                                      1, 1, 96, 1.0, 1, 0) == -1


@pytest.mark.skipif(cpu_amx.available(), reason="this CPU runs the kernel")
def test_a_call_without_amx_fails_loudly():
    """The wrapper's arguments reach the kernel, whose build here says it cannot run."""
    q, k_new, v_new, k_ctx, v_ctx, _, _ = operands(20, 30, DIM, torch.bfloat16, 1)
    with pytest.raises(RuntimeError, match=r"AMX prefill attention kernel failed \(-1\)"):
        amx_prefill.prefill_attention(q, k_new, v_new, k_ctx, v_ctx, DIM**-0.5)


def test_fits_only_bfloat16_heads_of_64_or_128_on_cpu():
    cpu = torch.device("cpu")
    assert not amx_prefill.fits(torch.float32, 64, cpu)
    assert not amx_prefill.fits(torch.bfloat16, 96, cpu)
    assert not amx_prefill.fits(torch.bfloat16, 256, cpu)
    assert amx_prefill.fits(torch.bfloat16, 64, cpu) == cpu_amx.available()
    assert amx_prefill.fits(torch.bfloat16, 128, cpu) == cpu_amx.available()


@needs_amx
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize(("q_len", "start"), [(1, 0), (5, 0), (16, 0), (17, 3), (40, 100),
                                              (130, 0), (100, 300), (1, 257), (300, 500)])
def test_matches_the_masked_softmax(q_len, start, dim):
    q, k_new, v_new, k_ctx, v_ctx, k_all, v_all = operands(q_len, start, dim, torch.bfloat16,
                                                           q_len + start)
    got = amx_prefill.prefill_attention(q, k_new, v_new, k_ctx if start else None,
                                        v_ctx if start else None, dim**-0.5)
    # p is rounded to bfloat16 before it meets V, as in the PyTorch bfloat16 kernels
    torch.testing.assert_close(got.double(), reference(q, k_all, v_all, start), atol=1.5e-2,
                               rtol=2e-2)


@needs_amx
@pytest.mark.parametrize("dim", DIMS)
def test_agrees_with_the_flash_split_it_replaces(dim):
    q, k_new, v_new, k_ctx, v_ctx, _, _ = operands(200, 333, dim, torch.bfloat16, 7)
    got = amx_prefill.prefill_attention(q, k_new, v_new, k_ctx, v_ctx, dim**-0.5)
    flash = flash_prefill.cached_chunk_attention(q, k_ctx, v_ctx, k_new, v_new, dim**-0.5)
    torch.testing.assert_close(got.float(), flash.float(), atol=1.5e-2, rtol=2e-2)
