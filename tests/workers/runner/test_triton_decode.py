"""The Triton decode kernel on CUDA, over the shapes the engine serves: block sizes, GQA
ratios, head sizes, dtypes and context lengths that cross blocks and the kernel's 64-token
tiles, against the torch path (gather + SDPA, `attention_backend: torch`) on the same device
and dtype, and against the float64 reference. Without a GPU these are skipped; the kernel's
arithmetic is also checked in Triton's interpreter on CPU (tests/workers/runner/
test_attention.py, test_sliding_window.py, test_kv_quant.py), on small shapes only.
"""

from __future__ import annotations

import pytest
import torch

from workers.runner.attention import build_metadata, paged_attention, reference_attention
from workers.runner.kv_quant import quantize_rows

pytestmark = pytest.mark.cuda
DEVICE = torch.device("cuda")

CASES = [  # block_size, heads, kv_heads, head_dim, dtype
    pytest.param(16, 9, 3, 64, torch.bfloat16, id="smollm2-shape"),
    pytest.param(16, 32, 8, 64, torch.bfloat16, id="llama-3.2-1b-shape"),
    pytest.param(16, 32, 8, 128, torch.bfloat16, id="llama-3.1-8b-shape"),
    pytest.param(8, 8, 1, 128, torch.float16, id="mqa-block8-fp16"),
    pytest.param(32, 4, 4, 64, torch.float32, id="mha-block32-fp32"),
    pytest.param(128, 28, 4, 128, torch.bfloat16, id="group7-block128"),
    pytest.param(16, 32, 32, 96, torch.bfloat16, id="head96-mha"),
    pytest.param(16, 8, 4, 256, torch.bfloat16, id="head256"),
    pytest.param(1, 6, 2, 64, torch.float32, id="block1-fp32"),
]


def lengths(block_size: int) -> list[int]:
    """Contexts of one token, either side of a block edge, across several blocks, either side
    of the kernel's 64-token tile, and long: each row of one launch has its own."""
    edges = [block_size - 1, block_size, block_size + 1, 2 * block_size + 3]
    return sorted({n for n in [1, 2, *edges, 63, 64, 65, 129, 700] if n > 0})


def paged(block_size, heads, kv_heads, head_dim, dtype, lens, seed=0):
    """A pool holding every row's context on shuffled blocks, and one query token a row."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables


def run_triton(q, k_cache, v_cache, tables, lens, block_size, scale, **kw):
    from workers.runner.triton_decode import paged_decode

    dev = DEVICE
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    out = paged_decode(q.to(dev), k_cache.to(dev), v_cache.to(dev), table.to(dev),
                       torch.tensor(lens, dtype=torch.int32, device=dev), scale, block_size,
                       **kw)
    return out.cpu()


def run_torch_path(q, k_cache, v_cache, tables, lens, block_size, scale, **kw):
    """The engine's torch decode path (grouped gathers and SDPA) on CUDA, same dtype."""
    dev = DEVICE
    batch = [(n - 1, 1, t) for n, t in zip(lens, tables, strict=True)]  # sorted by context
    group = q.shape[1] // k_cache.shape[1]
    meta = build_metadata(batch, block_size, k_cache.shape[1], group, dev, q.dtype)
    fresh = torch.empty(len(lens), k_cache.shape[1], q.shape[-1], dtype=q.dtype, device=dev)
    out = paged_attention(q.to(dev), fresh, fresh, k_cache.to(dev), v_cache.to(dev), meta,
                          scale, block_size, **kw)
    return out.cpu()


def reference(q, k_cache, v_cache, tables, lens, block_size, scale, **kw):
    rows = [(i, 1, n - 1, t) for i, (n, t) in enumerate(zip(lens, tables, strict=True))]
    return reference_attention(q.float(), k_cache, v_cache, rows, block_size, scale, **kw)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else \
        {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize(("block_size", "heads", "kv_heads", "head_dim", "dtype"), CASES)
def test_triton_decode_equals_the_torch_path_and_the_reference(block_size, heads, kv_heads,
                                                               head_dim, dtype):
    lens = lengths(block_size)
    q, k_cache, v_cache, tables = paged(block_size, heads, kv_heads, head_dim, dtype, lens)
    scale = head_dim**-0.5
    out = run_triton(q, k_cache, v_cache, tables, lens, block_size, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, k_cache, v_cache, tables, lens, block_size, scale)
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))
    torch_path = run_torch_path(q, k_cache, v_cache, tables, lens, block_size, scale)
    torch.testing.assert_close(out.float(), torch_path.float(), **tolerance(dtype))


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (100, None), (None, 30.0),
                                                 (40, 50.0)])
def test_triton_decode_window_and_softcap_on_bfloat16(window, softcap):
    """Gemma-style layers: the walk starts mid-block at len - window; scores soft-capped."""
    block_size, lens = 16, lengths(16)
    q, k_cache, v_cache, tables = paged(block_size, 8, 4, 128, torch.bfloat16, lens, seed=1)
    scale = 128**-0.5
    kw = {"window": window, "softcap": softcap}
    out = run_triton(q, k_cache, v_cache, tables, lens, block_size, scale, **kw)
    ref = reference(q, k_cache, v_cache, tables, lens, block_size, scale, **kw)
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_decode_reads_an_int8_pool_in_place(dtype):
    """`kv_cache_dtype: int8`: rows of int8 values and their float32 scale, read by the
    kernel as the float pool they stand for."""
    block_size, head_dim = 16, 128
    lens = lengths(block_size)
    q, k_cache, v_cache, tables = paged(block_size, 32, 8, head_dim, torch.float32, lens, seed=2)
    k8, v8 = (quantize_rows(c.reshape(-1, head_dim)).view(*c.shape[:3], -1)
              for c in (k_cache, v_cache))
    q = q.to(dtype)
    scale = head_dim**-0.5
    out = run_triton(q, k8, v8, tables, lens, block_size, scale)
    ref = reference(q, k8, v8, tables, lens, block_size, scale)  # dequantizes the rows
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))
