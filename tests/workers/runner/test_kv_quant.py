"""The int8 KV pool: rows round-trip within half a step, every attention path (torch decode
groups, the C decode kernel, flash and masked prefill chunks) reads it as the float pool it
stands for, and the budget holds >= 3.5x the tokens of float32."""

from __future__ import annotations

import pytest
import torch

from tests.devices import DEVICES, TRITON_DEVICES, exact, on_cuda
from tests.workers.runner.test_attention import BLOCK, build, layout
from workers.runner.attention import (
    build_metadata,
    paged_attention,
    reference_attention,
    write_kv,
)
from workers.runner.kv_cache import KVCacheSpec, allocate
from workers.runner.kv_quant import (
    check_kv_cache_dtype,
    dequantize_rows,
    head_dim_of,
    quantize_rows,
)

CPU = torch.device("cpu")


def test_rows_round_trip_within_half_a_step_and_carry_their_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=gen) * torch.rand(50, 1, generator=gen) * 10
    x[3] = 0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 68)
    scale = rows[:, 64:].contiguous().view(torch.float32)
    back = dequantize_rows(rows, torch.float32)
    assert torch.all((back - x).abs() <= scale / 2 + 1e-6)
    assert torch.all(back[3] == 0)  # a zero row stays zero
    assert torch.equal(quantize_rows(back), rows)  # on the grid, quantizing is idempotent
    assert dequantize_rows(rows, torch.bfloat16).dtype == torch.bfloat16


def int8_pools(k_cache, v_cache):
    """Int8 pools holding the float pools' rows quantized (scales inside each row)."""
    def pool(cache):
        blocks, heads, size, dim = cache.shape
        return quantize_rows(cache.reshape(-1, dim)).view(blocks, heads, size, dim + 4)
    return pool(k_cache), pool(v_cache)


def dequantized(cache):
    blocks, heads, size, row = cache.shape
    return dequantize_rows(cache.view(-1, row), torch.float32).view(blocks, heads, size, row - 4)


def on_grid(x):
    return dequantize_rows(quantize_rows(x.reshape(-1, x.shape[-1])), x.dtype).view(x.shape)


SEQS = [
    pytest.param([(5, 1), (17, 1), (0, 1)], id="decodes"),
    pytest.param([(12, 1), (0, 7), (30, 1), (6, 5), (3, 1)], id="mixed-chunked"),
    pytest.param([(i * 3 % 41, 1) for i in range(40)] + [(0, 4)], id="many-decode-groups"),
    pytest.param([(200, 1), (0, 1), (63, 1), (9, 6), (3, 6)], id="long-and-cached-chunks"),
]


# (decode, prefill, device): Triton in its interpreter on CPU tensors where there is no GPU,
# else on CUDA; the torch path on CUDA too
INT8_PATHS = [
    pytest.param("torch", "masked", "cpu", id="torch-masked"),
    pytest.param("cpu", "flash", "cpu", id="cpu-flash"),
    pytest.param("torch", "flash", "cpu", id="torch-flash"),
    *(pytest.param("triton", "masked", *p.values, id=f"triton-masked-{p.id}", marks=p.marks)
      for p in TRITON_DEVICES),
    on_cuda("torch", "masked", "cuda", id="torch-masked-cuda"),
]


@pytest.mark.parametrize("seqs", SEQS)
@pytest.mark.parametrize(("decode", "prefill", "device"), INT8_PATHS)
def test_int8_pool_attends_like_the_float_pool_it_holds(seqs, decode, prefill, device):
    q, k, v, k_cache, v_cache, batch, group = build(seqs, head_dim=16)
    # This step's K/V on the int8 grid: the fresh chunk's own attention (which reads them
    # unquantized) and the reference (which reads the pool) see the same numbers.
    k, v = on_grid(k), on_grid(v)
    k8, v8 = int8_pools(k_cache, v_cache)
    device = torch.device(device)
    q, k, v, k8, v8 = (t.to(device) for t in (q, k, v, k8, v8))
    meta = build_metadata(batch, BLOCK, k8.shape[1], group, device, q.dtype,
                          decode_kernel=None if decode == "torch" else decode,
                          prefill_kernel=prefill)
    write_kv(k8, v8, k, v, meta.write_rows)
    got = paged_attention(q, k, v, k8, v8, meta, 16**-0.5, BLOCK).cpu()
    q, k8, v8 = q.cpu(), k8.cpu(), v8.cpu()
    expected = reference_attention(q, dequantized(k8), dequantized(v8), layout(batch), BLOCK,
                                   16**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_written_rows_are_the_quantized_new_tokens():
    _, k, v, k_cache, v_cache, batch, group = build([(6, 3)], head_dim=16)
    k8, v8 = int8_pools(k_cache, v_cache)
    meta = build_metadata(batch, BLOCK, k8.shape[1], group, CPU)
    write_kv(k8, v8, k, v, meta.write_rows)
    table = batch[0][2]
    for i, pos in enumerate(range(6, 9)):
        row = k8[table[pos // BLOCK], :, pos % BLOCK]
        assert torch.equal(row, quantize_rows(k[i]))


def test_int8_budget_holds_over_3_5x_the_float32_tokens():
    for head_dim in (64, 128):
        f32 = KVCacheSpec(30, 3, head_dim, 16, torch.float32)
        int8 = KVCacheSpec(30, 3, head_dim, 16, torch.float32, kv_cache_dtype="int8")
        assert int8.bytes_per_block == 2 * 30 * 3 * (head_dim + 4) * 16
        assert f32.bytes_per_block / int8.bytes_per_block >= 3.5
    caches = allocate(KVCacheSpec(2, 1, 8, 4, torch.float32, kv_cache_dtype="int8"), 5, CPU)
    assert all(c.dtype == torch.int8 and c.shape == (5, 1, 4, 12) for pair in caches
               for c in pair)
    assert head_dim_of(caches[0][0]) == 8


def test_kv_cache_dtype_choices():
    assert check_kv_cache_dtype("int8", 64) == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        check_kv_cache_dtype("fp8", 64)
    with pytest.raises(ValueError, match="multiple of 4"):
        check_kv_cache_dtype("int8", 30)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_an_int8_pool_same_tokens_from_the_kernel_and_the_torch_path(
        tiny_llama_path, device):
    """The in-place kernel of the device (the C kernel on CPU, Triton on CUDA) and the torch
    path read the same int8 pool to the same tokens, in float32."""
    from workers import LLM, SamplingParams

    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 2000, (40,), generator=gen).tolist()
    # a prefix-cache hit: cached int8 blocks read by a later chunk
    prompts = [[*shared, 7, 8], [*shared, 9],
               torch.randint(3, 2000, (70,), generator=gen).tolist()]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    kernel = "cpu" if device == "cpu" else "triton"
    for backend in (kernel, "torch"):
        llm = LLM(str(tiny_llama_path), kv_cache_memory=4 << 20, kv_cache_dtype="int8",
                  attention_backend=backend, block_size=8, **exact(device))
        assert llm.engine.runner.attention_backend == backend
        assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
        assert llm.engine.runner.kv_caches[0][0].device.type == device
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[kernel] == outs["torch"]


@pytest.mark.parametrize("head_dim", [64, 80, 24])  # whole 64-wide groups, a 16 tail, no AVX
@pytest.mark.parametrize("plain", [False, True])
def test_c_kernel_on_int8_equals_it_on_the_dequantized_pool(head_dim, plain):
    """The kernel dequantizes a block as `dequantize_rows` does (one rounding), then runs the
    float code: the same bits as the float kernel over the dequantized pool."""
    from workers.runner import cpu_decode

    gen = torch.Generator().manual_seed(head_dim)
    blocks, heads, block = 40, 2, 8
    k8, v8 = int8_pools(torch.randn(blocks, heads, block, head_dim, generator=gen),
                        torch.randn(blocks, heads, block, head_dim, generator=gen))
    q = torch.randn(5, heads * 3, head_dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[:35].view(5, 7).to(torch.int32).contiguous()
    lens = torch.tensor([1, 8, 9, 30, 56], dtype=torch.int32)
    got = cpu_decode.paged_decode(q, k8, v8, tables, lens, 0.125, block, plain=plain)
    expected = cpu_decode.paged_decode(q, dequantized(k8), dequantized(v8), tables, lens, 0.125,
                                       block, plain=plain)
    assert torch.equal(got, expected)
