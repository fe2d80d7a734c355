"""Building and calling the C decode kernel (its numbers are checked in test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.runner.conftest import build_targets
from workers import LLM, SamplingParams
from workers.runner import cpu_decode


def test_the_kernel_is_built_once_into_the_cache_and_reused(fresh_build):
    cpu_decode.load_library()
    built = list(fresh_build.glob("paged_decode-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_decode.load_library.cache_clear()  # as a new process would
    cpu_decode.load_library()
    assert list(fresh_build.glob("*")) == built  # no leftover temporary folder
    assert built[0].stat().st_mtime_ns == stamp


def test_a_failing_compiler_is_a_clear_error(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="building the CPU decode kernel failed"):
        cpu_decode.load_library()
    assert not list(fresh_build.glob("*.so"))


def test_strided_query_rows_are_read_where_they_lie():
    """The model hands the kernel q as a view into the fused qkv output."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 2, 4, 8, generator=g)
    v_cache = torch.randn(6, 2, 4, 8, generator=g)
    qkv = torch.randn(3, 6 * 8 + 2 * 2 * 8, generator=g)
    q = qkv[:, : 6 * 8].view(3, 6, 8)
    tables = torch.tensor([[5, 1], [2, 0], [3, 4]], dtype=torch.int32)
    lens = torch.tensor([7, 2, 8], dtype=torch.int32)
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.3, 4)
    same = cpu_decode.paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, 0.3, 4)
    assert torch.equal(out, same)
    # row 1 sees two tokens of block 2: a plain softmax over them
    k = k_cache[2, :, :2]  # [kv heads, tokens, dim]
    v = v_cache[2, :, :2]
    for head in range(6):
        kv = head // 3
        weights = torch.softmax(k[kv] @ q[1, head] * 0.3, dim=0)
        torch.testing.assert_close(out[1, head], weights @ v[kv], rtol=1e-5, atol=1e-6)


def test_shapes_past_the_limits_are_refused():
    q = torch.zeros(1, 17, 8)
    cache = torch.zeros(1, 1, 4, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="group <= 16"):
        cpu_decode.paged_decode(q, cache, cache, tables, lens, 1.0, 4)


def dense_reference(q, k_cache, v_cache, tables, lens, scale, block_size):
    """Each row's context gathered position by position, then a plain softmax per head."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for row in range(q.shape[0]):
        slots = [(int(tables[row, p // block_size]), p % block_size)
                 for p in range(int(lens[row]))]
        k = torch.stack([k_cache[b, :, offset] for b, offset in slots])
        v = torch.stack([v_cache[b, :, offset] for b, offset in slots])
        for head in range(q.shape[1]):
            weights = torch.softmax(k[:, head // group] @ q[row, head] * scale, dim=0)
            out[row, head] = weights @ v[:, head // group]
    return out


@pytest.mark.parametrize("head_dim", [64, 80, 24])  # whole 64-wide groups, a 16 tail, no AVX
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("march", build_targets())
def test_every_code_path_equals_the_dense_reference(head_dim, plain, march):
    """AVX-512 or AVX2 where the build has it and head_dim allows, and the portable loops,
    built for this CPU and for the AVX2 and SSE2 targets other CPUs get."""
    g = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks = 16, 80
    k_cache = torch.randn(num_blocks, 2, block_size, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, 2, block_size, head_dim, generator=g)
    lens = torch.tensor([1, 16, 17, 200, 95], dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=g)
    tables = order[: 5 * 13].view(5, 13).to(torch.int32).contiguous()
    q = torch.randn(5, 6, head_dim, generator=g) * 3  # peaked softmax: exp's range matters
    scale = head_dim**-0.5
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, scale, block_size,
                                  plain=plain, march=march)
    ref = dense_reference(q, k_cache, v_cache, tables, lens, scale, block_size)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_auto_falls_back_to_torch_when_the_build_fails_and_explicit_cpu_fails(
        fresh_build, monkeypatch, tiny_llama_path):
    monkeypatch.setenv("CC", "false")
    llm = LLM(str(tiny_llama_path), kv_cache_memory=1 << 20, device="cpu", dtype="float32")
    assert llm.engine.runner.attention_backend == "torch"
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3,
                                                   ignore_eos=True))
    assert len(out[0].token_ids) == 3
    with pytest.raises(RuntimeError, match="building the CPU decode kernel failed"):
        LLM(str(tiny_llama_path), kv_cache_memory=1 << 20, device="cpu", dtype="float32",
            attention_backend="cpu")


def test_an_unwritable_cache_or_a_missing_compiler_is_a_clear_error(fresh_build, monkeypatch,
                                                                     tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache would go below a file
    with pytest.raises(RuntimeError, match="building the CPU decode kernel failed"):
        cpu_decode.load_library()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="No such file"):
        cpu_decode.load_library()


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(80, 5), (40, 40), (9, 3)])
@pytest.mark.parametrize("march", build_targets())
def test_tasks_split_a_sequence_heads_where_the_buffers_end(num_heads, num_kv_heads, march):
    """A task holds up to 32 query rows: a group of 16 takes two KV heads per task (the last
    task of a sequence one), groups of one take 32 then 8; SmolLM2's 9/3 takes all three."""
    g = torch.Generator().manual_seed(num_heads)
    block_size, num_blocks, head_dim = 4, 24, 16
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g)
    lens = torch.tensor([3, 9, 20], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[:15].view(3, 5).to(torch.int32).contiguous()
    q = torch.randn(3, num_heads, head_dim, generator=g)
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.25, block_size,
                                  march=march)
    ref = dense_reference(q, k_cache, v_cache, tables, lens, 0.25, block_size)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("march", build_targets())
def test_a_bfloat16_pool_is_read_in_place_with_bfloat16_queries(head_dim, plain, march):
    """bfloat16 q and pool: the kernel widens to float32 and rounds only its output, so it
    equals the float32 reference over the same (bfloat16-valued) numbers within one bfloat16
    rounding."""
    g = torch.Generator().manual_seed(7 + head_dim)
    block_size, num_blocks = 16, 40
    k_cache = torch.randn(num_blocks, 3, block_size, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, 3, block_size, head_dim, generator=g).bfloat16()
    lens = torch.tensor([1, 33, 160], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[:30].view(3, 10).to(torch.int32)
    q = (torch.randn(3, 9, head_dim, generator=g) * 3).bfloat16()
    scale = head_dim**-0.5
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables.contiguous(), lens, scale,
                                  block_size, plain=plain, march=march)
    assert out.dtype == torch.bfloat16
    ref = dense_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale,
                          block_size)
    torch.testing.assert_close(out.float(), ref, rtol=8e-3, atol=8e-3)


def test_a_bfloat16_model_takes_the_kernel_only_over_a_bfloat16_pool():
    assert cpu_decode.fits(3, 64, 16, torch.bfloat16)
    assert not cpu_decode.fits(3, 64, 16, torch.bfloat16, int8_pool=True)
    assert cpu_decode.fits(3, 64, 16, torch.float32, int8_pool=True)
    assert not cpu_decode.fits(3, 64, 16, torch.float16)
