"""The C element-wise kernels against PyTorch's ops, and where the engine uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.workers.runner.conftest import build_targets
from workers import LLM, SamplingParams
from workers.runner import cpu_amx, cpu_fused
from workers.runner.attention import write_kv
from workers.runner.linear import onednn_runs, upcast_preferred
from workers.runner.model import RMSNorm
from workers.runner.rope import apply_rotary

TARGETS = build_targets()


@pytest.mark.parametrize("rows, n", [(1, 1536), (7, 37), (64, 256), (300, 96)])
@pytest.mark.parametrize("march", TARGETS)
def test_silu_mul_matches_torch(rows, n, march):
    gen = torch.Generator().manual_seed(rows * n)
    gate_up = torch.randn(rows, 2 * n, generator=gen) * 6  # saturating both ways
    gate, up = gate_up.split(n, dim=-1)
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up, march=march), F.silu(gate) * up,
                               rtol=2e-6, atol=1e-6)


def test_silu_mul_reads_strided_rows():
    wide = torch.randn(5, 100)
    gate_up = wide[:, :80]  # row stride 100, not 80
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up),
                               F.silu(gate_up[:, :40]) * gate_up[:, 40:], rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 129])
@pytest.mark.parametrize("width", [96, 100])  # 100: a vector build's element tail too
@pytest.mark.parametrize("march", TARGETS)
def test_add_rms_norm_matches_the_module_and_updates_the_residual(rows, width, march):
    norm = RMSNorm(width, 1e-5)
    norm.weight.data = torch.randn(width)
    x, residual = torch.randn(rows, width), torch.randn(rows, width) * 3
    want_residual = residual + x
    want = norm(want_residual)
    got = cpu_fused.add_rms_norm(x, residual, norm.weight, norm.eps, march=march)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(residual, want_residual)  # in place, exactly the sum
    alone = residual.clone()
    torch.testing.assert_close(cpu_fused.add_rms_norm(None, alone, norm.weight, norm.eps,
                                                      march=march),
                               norm(want_residual), rtol=1e-5, atol=1e-6)
    assert torch.equal(alone, residual)  # nothing added


@pytest.mark.parametrize("march", TARGETS)
def test_bfloat16_kernels_compute_in_float32_and_round_once(march):
    """Each bfloat16 result is the float32 result over the same inputs, rounded once: within
    one bfloat16 step (2^-8 relative) of it, and the residual is the sum rounded as torch
    rounds it."""
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(9, 2 * 200, generator=gen) * 6).bfloat16()
    gate, up = gate_up.float().split(200, dim=-1)
    got = cpu_fused.silu_mul(gate_up, march=march)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=4e-3, atol=1e-5)

    weight = torch.randn(100, generator=gen).bfloat16()  # 6 vectors of 16 and a tail
    x = torch.randn(5, 100, generator=gen).bfloat16()
    residual = (torch.randn(5, 100, generator=gen) * 3).bfloat16()
    want_residual = residual + x  # torch's bfloat16 add: float32 sum, rounded
    norm = RMSNorm(100, 1e-5)
    norm.weight.data = weight.float()
    want = norm(want_residual.float())
    got = cpu_fused.add_rms_norm(x, residual, weight, 1e-5, march=march)
    assert torch.equal(residual, want_residual)
    torch.testing.assert_close(got.float(), want, rtol=4e-3, atol=1e-5)

    heads, dim = 3, 32
    cos_table, sin_table = torch.randn(20, dim // 2), torch.randn(20, dim // 2)
    positions = torch.tensor([4, 0, 19])
    qkv = torch.randn(3, heads * dim, generator=gen).bfloat16()
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    want_rot = apply_rotary(qkv.float().view(3, heads, dim), cos, sin).view(3, -1)
    cpu_fused.rope_(qkv, positions, cos_table, sin_table, heads, dim, march=march)
    torch.testing.assert_close(qkv.float(), want_rot, rtol=4e-3, atol=1e-5)


@pytest.mark.parametrize("march", TARGETS)
@pytest.mark.parametrize("dim", [32, 40])  # 40: halves of 20, a vector build's tail too
def test_rope_rotates_q_and_k_in_place_and_leaves_v(march, dim):
    heads, kv_heads, tokens = 4, 2, 6
    cos_table = torch.randn(50, dim // 2)
    sin_table = torch.randn(50, dim // 2)
    positions = torch.tensor([7, 0, 49, 3, 3, 20])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    before = qkv.clone()
    cpu_fused.rope_(qkv, positions, cos_table, sin_table, heads + kv_heads, dim, march=march)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    q, k, v = before.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q = apply_rotary(q.reshape(tokens, heads, dim), cos, sin).reshape(tokens, -1)
    want_k = apply_rotary(k.reshape(tokens, kv_heads, dim), cos, sin).reshape(tokens, -1)
    torch.testing.assert_close(qkv[:, : heads * dim], want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, heads * dim: (heads + kv_heads) * dim], want_k,
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v)


def test_auto_picks_the_kernels_for_float32_and_bfloat16_on_cpu_only():
    cpu = torch.device("cpu")
    assert cpu_fused.pick_elementwise("auto", cpu, torch.float32) == "cpu"
    assert cpu_fused.pick_elementwise("auto", cpu, torch.bfloat16) == "cpu"
    assert cpu_fused.pick_elementwise("auto", cpu, torch.float16) == "torch"
    assert cpu_fused.pick_elementwise("auto", torch.device("cuda"), torch.float32) == "torch"
    assert cpu_fused.pick_elementwise("torch", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="needs a CPU device and float32 or bfloat16"):
        cpu_fused.pick_elementwise("cpu", cpu, torch.float16)
    with pytest.raises(ValueError, match="elementwise must be one of"):
        cpu_fused.pick_elementwise("fast", cpu, torch.float32)


def test_a_failed_build_falls_back_under_auto_and_is_an_error_when_asked_for(
        fresh_build, monkeypatch, tiny_llama_path):
    monkeypatch.setenv("CC", "false")
    llm = LLM(str(tiny_llama_path), kv_cache_memory=1 << 20, device="cpu", dtype="float32")
    assert llm.engine.runner.model.elementwise == "torch"
    with pytest.raises(ValueError, match="building the CPU element-wise kernels failed"):
        LLM(str(tiny_llama_path), kv_cache_memory=1 << 20, device="cpu", dtype="float32",
            elementwise="cpu")
    assert not list(fresh_build.glob("*.so"))


def test_the_engine_gives_the_same_tokens_with_either(tiny_llama_path):
    """Greedy tokens over prompts long enough to prefill in chunks beside decodes."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 40, 130))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name in ("torch", "cpu"):
        llm = LLM(str(tiny_llama_path), kv_cache_memory=1 << 22, device="cpu",
                  dtype="float32", elementwise=name, max_num_batched_tokens=64)
        assert llm.engine.runner.model.elementwise == name
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["cpu"] == outs["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("march", TARGETS)
def test_store_kv_writes_what_write_kv_writes(dtype, march):
    """The C copy of a step's K/V heads from the qkv rows into the pool equals PyTorch's
    index_copy, and touches no other row."""
    heads, kv_heads, dim, tokens, blocks, block_size = 4, 2, 32, 5, 6, 4
    qkv = torch.randn(tokens, 100 + (heads + 2 * kv_heads) * dim).to(dtype)[:, 100:]
    k_col = heads * dim
    slots = torch.tensor([0, 9, 10, 23, 5])
    rows = ((slots // block_size * kv_heads * block_size + slots % block_size)[:, None]
            + torch.arange(kv_heads) * block_size).flatten()
    want_k = torch.randn(blocks, kv_heads, block_size, dim).to(dtype)
    want_v = torch.randn(blocks, kv_heads, block_size, dim).to(dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    k = qkv[:, k_col: k_col + kv_heads * dim].reshape(tokens, kv_heads, dim)
    v = qkv[:, k_col + kv_heads * dim:].reshape(tokens, kv_heads, dim)
    write_kv(want_k, want_v, k, v, rows)
    cpu_fused.store_kv(qkv, k_col, kv_heads, dim, rows, got_k, got_v, march=march)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def _auto_bf16_linear() -> str:
    if cpu_amx.available():
        return "amx"
    if cpu_amx.dot_preferred():
        return "avx512_bf16"
    return "onednn_upcast" if upcast_preferred(torch.bfloat16) else "onednn_packed"


@pytest.mark.skipif(not onednn_runs(torch.float32), reason="this torch has no oneDNN matmul")
@pytest.mark.parametrize("linear_name", ["auto", "onednn_upcast"])
def test_a_bfloat16_engine_runs_on_the_c_kernels_and_tracks_float32(tiny_llama_path,
                                                                     linear_name):
    """bfloat16 on CPU: the decode kernel, the element-wise kernels and blocked weights are
    chosen, and while its greedy tokens agree with the float32 engine's, each token's logprob
    is float32's within bfloat16 noise (the all-PyTorch bfloat16 engine is off by up to 0.13
    here). A random tiny model is full of near-ties, so any rounding forks the sequences after
    some tokens; a wrong kernel would fork them at once or move the logprobs far more.
    `onednn_upcast` (bfloat16 as float32 matmuls) runs wherever float32 oneDNN does."""
    if (linear_name == "auto" and not onednn_runs(torch.bfloat16)
            and not upcast_preferred(torch.bfloat16)):
        pytest.skip("this CPU has no bfloat16 matmul")
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 40, 130))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for dtype, name in (("float32", "torch"), ("bfloat16", "auto")):
        llm = LLM(str(tiny_llama_path), kv_cache_memory=1 << 22, device="cpu", dtype=dtype,
                  elementwise=name, attention_backend=name,
                  linear_backend=linear_name if dtype == "bfloat16" else name,
                  max_num_batched_tokens=64)
        runner = llm.engine.runner
        if dtype == "bfloat16":
            assert runner.model.elementwise == runner.attention_backend == "cpu"
            assert runner.linear_backend == (_auto_bf16_linear() if linear_name == "auto"
                                             else linear_name)
        outs[dtype] = [o.outputs[0] for o in llm.generate(prompts, params)]
    compared = 0
    for got, want in zip(outs["bfloat16"], outs["float32"], strict=True):
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            if a.token_id != b.token_id:
                break
            assert abs(a.logprob - b.logprob) < 0.2
            compared += 1
    assert compared >= 24  # the prefill's token and many decode steps on each prompt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1024, 71, 200])  # whole 64-column passes, a tail, both
@pytest.mark.parametrize("march", TARGETS)
def test_moe_sum_weights_and_gathers_each_tokens_rows(n, dtype, march):
    """y[t] = sum_j w[t, j] * rows[index[t, j]], summed in float32 and rounded once, for any
    width (the AVX-512 build takes 64 columns a pass and the rest one at a time); a NaN row
    stays NaN."""
    gen = torch.Generator().manual_seed(n)
    tokens, k = 37, 8
    rows = torch.randn(tokens * k, n, generator=gen).to(dtype)
    rows[5, 3] = float("nan")
    index = torch.randperm(tokens * k, generator=gen).view(tokens, k)
    weights = torch.rand(tokens, k, generator=gen)
    got = cpu_fused.moe_sum(rows, index, weights, march=march)
    want = (rows.double()[index] * weights.double().unsqueeze(-1)).sum(dim=1)
    assert got.dtype == dtype and got.shape == (tokens, n)
    nan_token = int((index == 5).nonzero()[0, 0])
    assert torch.isnan(got[nan_token, 3]) and int(torch.isnan(got).sum()) == 1
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3,
                                                                        "atol": 1e-2}
    torch.testing.assert_close(got.double(), want, equal_nan=True, **tol)
