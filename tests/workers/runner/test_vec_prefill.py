"""The vector prefill attention kernel against a float64 masked softmax: float32 and bfloat16,
heads of 64 and 128, chunks with and without cached context, lengths off every block size
(32 or 16 queries, 64 keys, 8 or 4 keys), grouped heads, q/k/v as strided views of one fused
projection; its AVX-512 build (the CPU's own), its AVX2 build, and the SSE build that
refuses."""

from __future__ import annotations

import pytest
import torch

from workers.runner import cbuild, flash_prefill, vec_prefill

HEADS, KV_HEADS = 9, 3
CPU = torch.device("cpu")
needs_f32 = pytest.mark.skipif(not vec_prefill.fits(torch.float32, 64, CPU),
                               reason="this CPU has neither AVX-512 nor AVX2")
SHAPES = [(1, 0), (5, 0), (32, 0), (33, 0), (17, 3), (40, 100), (130, 0), (100, 300), (1, 257),
          (300, 500), (64, 63)]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [q_len, heads, dim]; k, v [kv_heads, start + q_len, dim]; float64 throughout."""
    q_len, dim = q.shape[0], q.shape[-1]
    group = q.shape[1] // k.shape[0]
    kf = k.double().repeat_interleave(group, 0)
    vf = v.double().repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ kf.transpose(1, 2) * dim**-0.5
    hidden = torch.arange(k.shape[1])[None, :] > torch.arange(start, start + q_len)[:, None]
    return (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ vf).transpose(0, 1)


def operands(q_len: int, start: int, dim: int, dtype: torch.dtype, seed: int):
    """q, k_new, v_new as views of one fused projection; the context as a gathered pool."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(q_len, (HEADS + 2 * KV_HEADS) * dim, generator=gen).to(dtype)
    q = fused[:, : HEADS * dim].view(q_len, HEADS, dim)
    k_new = fused[:, HEADS * dim: (HEADS + KV_HEADS) * dim].view(q_len, KV_HEADS, dim)
    v_new = fused[:, (HEADS + KV_HEADS) * dim:].view(q_len, KV_HEADS, dim)
    pool = torch.randn(2, KV_HEADS, start + 37, dim, generator=gen).to(dtype)  # padded blocks
    k_ctx, v_ctx = pool[0, :, :start], pool[1, :, :start]
    k_all = torch.cat([k_ctx, k_new.transpose(0, 1)], dim=1)
    v_all = torch.cat([v_ctx, v_new.transpose(0, 1)], dim=1)
    return q, k_new, v_new, k_ctx, v_ctx, k_all, v_all


def run(q_len: int, start: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q, k_new, v_new, k_ctx, v_ctx, k_all, v_all = operands(q_len, start, dim, dtype,
                                                           q_len + start + dim)
    got = vec_prefill.prefill_attention(q, k_new, v_new, k_ctx if start else None,
                                        v_ctx if start else None, dim**-0.5)
    return got, reference(q, k_all, v_all, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("q_len", "start"), SHAPES)
def test_matches_the_masked_softmax(q_len, start, dim, dtype):
    if not vec_prefill.fits(dtype, dim, CPU):
        pytest.skip("this CPU has neither AVX-512 nor AVX2")
    got, want = run(q_len, start, dim, dtype)
    assert got.dtype == dtype
    # bfloat16: p is rounded to bfloat16 before it meets V, as in PyTorch's bfloat16 kernels
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1.5e-2, 2e-2)
    torch.testing.assert_close(got.double(), want, atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("start", [0, 45])
def test_the_flash_split_takes_an_empty_context(start):
    """No cached tokens is the chunk's own causal attention (torch's kernel alone would stop
    the process on the empty context: bench/archive/prefill_attention.py --contexts 0 did)."""
    q, k_new, v_new, k_ctx, v_ctx, k_all, v_all = operands(20, start, 64, torch.float32, 3)
    got = flash_prefill.cached_chunk_attention(q, k_ctx, v_ctx, k_new, v_new, 64**-0.5)
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, k_all, v_all, start), atol=1e-5,
                               rtol=1e-5)


@needs_f32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agrees_with_the_flash_split_it_replaces(dtype):
    if not vec_prefill.fits(dtype, 64, CPU):
        pytest.skip(f"no vector kernel for {dtype} on this CPU")
    q, k_new, v_new, k_ctx, v_ctx, _, _ = operands(200, 333, 64, dtype, 7)
    got = vec_prefill.prefill_attention(q, k_new, v_new, k_ctx, v_ctx, 64**-0.5)
    flash = flash_prefill.cached_chunk_attention(q, k_ctx, v_ctx, k_new, v_new, 64**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(got.float(), flash.float(), atol=tol, rtol=tol)


@needs_f32
def test_rows_do_not_depend_on_the_chunk_they_came_in():
    """A query's output is the same whether its chunk starts at it or 40 queries earlier
    (other lanes of its 32-query task, other spans of keys)."""
    q, k_new, v_new, _, _, _, _ = operands(100, 0, 64, torch.float32, 3)
    whole = vec_prefill.prefill_attention(q, k_new, v_new, None, None, 0.125)
    tail = vec_prefill.prefill_attention(q[40:], k_new[40:], v_new[40:],
                                         k_new[:40].transpose(0, 1), v_new[:40].transpose(0, 1),
                                         0.125)
    torch.testing.assert_close(tail, whole[40:], atol=1e-6, rtol=1e-6)


def test_a_build_that_cannot_serve_the_call_fails_loudly():
    q, k_new, v_new, _, _, _, _ = operands(8, 0, 64, torch.float32, 2)
    with pytest.raises(RuntimeError, match=r"kernel failed \(-1\)"):
        vec_prefill.prefill_attention(q, k_new, v_new, None, None, 0.125, march="x86-64")
    with pytest.raises(ValueError, match=r"no vector prefill kernel for torch\.float16"):
        vec_prefill.prefill_attention(q.half(), k_new.half(), v_new.half(), None, None, 0.125)


def test_the_sse_build_refuses():
    lib = vec_prefill.load_library("x86-64")
    assert lib.vec_prefill_supports(0, 64) == lib.vec_prefill_supports(2, 64) == 0
    x = torch.zeros(16)
    p = x.data_ptr()
    assert lib.vec_prefill_attention(p, 64, 64, p, p, 64, 64, p, p, 64, 64, p, 64, 64, 1, 0, 1,
                                     1, 64, 0, 1.0, 1, 0) == -1


@pytest.mark.skipif(not {"avx2", "fma"} <= cbuild.cpu_flags(), reason="this CPU has no AVX2")
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("q_len", "start"), SHAPES)
def test_the_avx2_build_matches_the_masked_softmax(q_len, start, dim):
    """8-lane vectors, 16 queries a task: float32 only (bfloat16 needs AVX-512 BF16)."""
    lib = vec_prefill.load_library("x86-64-v3")
    assert lib.vec_prefill_supports(0, dim) == 1 and lib.vec_prefill_supports(2, dim) == 0
    q, k_new, v_new, k_ctx, v_ctx, k_all, v_all = operands(q_len, start, dim, torch.float32,
                                                           q_len + start)
    out = vec_prefill.prefill_attention(q, k_new, v_new, k_ctx if start else None,
                                        v_ctx if start else None, dim**-0.5, march="x86-64-v3")
    torch.testing.assert_close(out.double(), reference(q, k_all, v_all, start), atol=1e-5,
                               rtol=1e-5)


@needs_f32
def test_the_native_build_refuses_other_heads_and_dtypes():
    lib = vec_prefill.load_library()
    assert lib.vec_prefill_supports(0, 64) == lib.vec_prefill_supports(0, 128) == 1
    assert lib.vec_prefill_supports(0, 96) == 0
    assert lib.vec_prefill_supports(1, 64) == 0  # float16 has no code here
    assert lib.vec_prefill_supports(2, 64) == int("avx512_bf16" in cbuild.cpu_flags())


def test_fits_only_cpu_heads_of_64_or_128():
    flags = cbuild.cpu_flags()
    assert not vec_prefill.fits(torch.float32, 64, torch.device("cuda"))
    assert not vec_prefill.fits(torch.float32, 96, CPU)
    assert not vec_prefill.fits(torch.float16, 64, CPU)
    assert vec_prefill.fits(torch.float32, 128, CPU) == ("avx512f" in flags
                                                         or {"avx2", "fma"} <= flags)
    assert vec_prefill.preferred(torch.float32, 128, CPU) == ("avx512f" in flags)


@pytest.mark.skipif(not {"avx2", "fma"} <= cbuild.cpu_flags(), reason="this CPU has no AVX2")
@pytest.mark.parametrize(("q_len", "start"), [(33, 0), (100, 300)])
def test_bfloat16_without_avx512_bf16_is_widened_to_the_float32_kernel(q_len, start):
    """The AVX2 build has no bfloat16 code: the chunk goes through its float32 kernel, so the
    only rounding is the output's."""
    assert vec_prefill.widens(torch.bfloat16, 64, "x86-64-v3")
    assert not vec_prefill.widens(torch.float32, 64, "x86-64-v3")
    q, k_new, v_new, k_ctx, v_ctx, k_all, v_all = operands(q_len, start, 64, torch.bfloat16, 11)
    out = vec_prefill.prefill_attention(q, k_new, v_new, k_ctx if start else None,
                                        v_ctx if start else None, 0.125, march="x86-64-v3")
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    want = reference(q, k_all, v_all, start)
    assert torch.all((out.double() - want).abs() <= want.abs() * 2**-8 + 1e-6)
