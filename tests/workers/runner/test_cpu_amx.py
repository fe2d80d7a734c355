"""The tile-layout bfloat16 matmuls, AMX and AVX-512 BF16 dot products (`dot`): their product,
their row independence, the model's choice of them by rows, and the build for CPUs without
them (which answers "not available"). Each kernel's tests skip where the CPU lacks it."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from workers import LLM, SamplingParams
from workers.runner import cpu_amx
from workers.runner.linear import Linear, linear_kernel
from workers.runner.model import LlamaModel

needs_amx = pytest.mark.skipif(not cpu_amx.available(),
                               reason="this CPU has no AMX bfloat16 (or Linux refused it)")
needs_dot = pytest.mark.skipif(not cpu_amx.dot_available(),
                               reason="this CPU has no AVX-512 BF16")
KERNELS = [pytest.param("amx", marks=needs_amx), pytest.param("dot", marks=needs_dot)]
BACKEND = {"amx": "amx", "dot": "avx512_bf16"}


def test_a_build_without_amx_or_avx512_bf16_refuses_every_product():
    """The x86-64-v3 (AVX2) target builds on any x86 machine with a compiler. Packing is
    plain C, so it works there too: the layout is checked element by element."""
    lib = cpu_amx.load_library("x86-64-v3")
    assert lib.amx_init() == -1
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).bfloat16()
    packed = torch.empty(32 * 64, dtype=torch.bfloat16)
    assert lib.amx_pack(w.data_ptr(), packed.data_ptr(), 32, 64) == 0
    # [column block][k block][k pair][column][2]: block 1, k block 1, pair 3, column 5, k odd
    index = ((1 * 2 + 1) * 16 + 3) * 32 + 5 * 2 + 1
    assert packed[index] == w[16 + 5, 32 + 2 * 3 + 1]
    for gemm in (lib.amx_gemm, lib.dot_gemm):
        assert gemm(w.data_ptr(), packed.data_ptr(), w.data_ptr(), 1, 32, 32, 32, 32, 0, 1) == -1


def test_fits_and_packable():
    assert cpu_amx.packable(torch.zeros(64, 96, dtype=torch.bfloat16))
    assert not cpu_amx.packable(torch.zeros(48, 96, dtype=torch.bfloat16))  # 48 % 32
    assert not cpu_amx.packable(torch.zeros(64, 96))  # float32
    assert cpu_amx.fits(torch.zeros(3, 5, 96, dtype=torch.bfloat16))
    assert not cpu_amx.fits(torch.zeros(cpu_amx.MAX_ROWS["amx"] + 1, 96, dtype=torch.bfloat16))
    assert cpu_amx.fits(torch.zeros(cpu_amx.MAX_ROWS["dot"], 96, dtype=torch.bfloat16), "dot")
    assert not cpu_amx.fits(torch.zeros(cpu_amx.MAX_ROWS["dot"] + 1, 96, dtype=torch.bfloat16),
                            "dot")
    assert not cpu_amx.fits(torch.zeros(4, 96))
    assert not cpu_amx.fits(torch.zeros(96, 4, dtype=torch.bfloat16).t())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 64, 100, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (64, 1536), (96, 64)])
def test_product_is_the_float32_sum_of_bfloat16_inputs(rows, out_features, in_features, kernel):
    """(960, 576) and (64, 1536) take the dot kernel's 32-column panels, (96, 64) its 64-column
    panels and a 32-column tail (2 threads); rows cover every row tail."""
    gen = torch.Generator().manual_seed(rows + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    exact = x.float() @ w.float().T
    packed = cpu_amx.pack(w)
    got32 = cpu_amx.amx_linear(x, packed, out_features, out_dtype=torch.float32, kernel=kernel)
    torch.testing.assert_close(got32, exact, rtol=1e-5, atol=1e-4)
    got = cpu_amx.amx_linear(x, packed, out_features, kernel=kernel)
    assert got.dtype == torch.bfloat16
    # sums in another order round to a neighbouring bfloat16 at most
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_does_not_depend_on_its_batch_mates_or_stride(kernel):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(192, 256, generator=gen).bfloat16()
    wide = torch.randn(70, 320, generator=gen).bfloat16()
    x = wide[:, :256]  # rows 320 apart
    packed = cpu_amx.pack(w)
    full = cpu_amx.amx_linear(x, packed, 192, kernel=kernel)
    assert torch.equal(full, cpu_amx.amx_linear(x.contiguous(), packed, 192, kernel=kernel))
    for rows in (1, 15, 33):
        assert torch.equal(cpu_amx.amx_linear(x[:rows], packed, 192, kernel=kernel), full[:rows])


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_model_uses_the_tile_kernel_for_few_rows_and_onednn_for_many(monkeypatch, kernel):
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaModel(config, max_positions=64).to(torch.bfloat16)
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.use_linear_kernel(linear_kernel(BACKEND[kernel]))
    model.pack_linears(tiles=kernel)
    limit = cpu_amx.MAX_ROWS[kernel]
    calls: list[int] = []
    real = cpu_amx.amx_linear

    def counting(x, packed, out_features, **kw):
        assert kw["kernel"] == kernel
        calls.append(x.shape[0])
        return real(x, packed, out_features, **kw)

    monkeypatch.setattr(cpu_amx, "amx_linear", counting)
    mlp = model.layers[0].mlp
    for rows in (4, limit + 1):
        calls.clear()
        x = torch.randn(rows, 64).bfloat16()
        gate_up = F.linear(x.float(), dense["layers.0.mlp.gate_up_proj.weight"].float())
        torch.testing.assert_close(mlp.gate_up_proj(x).float(), gate_up, rtol=2 ** -7,
                                   atol=1e-2)
        logits = x.float() @ dense["embed_tokens.weight"].float().T
        few = rows <= limit  # the tile kernel gives the head's float32 sums unrounded
        torch.testing.assert_close(model.compute_logits(x), logits,
                                   rtol=1e-4 if few else 2 ** -7, atol=1e-3 if few else 1e-2)
        assert calls == ([rows, rows] if few else [])


def test_the_copy_may_take_a_quarter_of_the_memory_available():
    assert cpu_amx.copy_fits(100, available=400)
    assert not cpu_amx.copy_fits(101, available=400)
    assert cpu_amx.copy_fits(1 << 20)  # this machine has more than 4 MiB free


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("asked", "fits", "expected"), [
    ("auto", True, "tiles"), ("auto", False, "onednn_packed"), ("tiles", False, "tiles"),
])
def test_auto_skips_the_tile_copy_where_memory_is_short(tiny_llama_path, monkeypatch, kernel,
                                                        asked, fits, expected):
    """`tiles` is the kernel's backend; under auto the CPU's best (AMX over dot products)."""
    if kernel == "dot" and asked == "auto":
        monkeypatch.setattr(cpu_amx, "available", lambda: False)
        monkeypatch.setattr(cpu_amx, "dot_preferred", lambda: True)
    asked, expected = (BACKEND[kernel] if name == "tiles" else name for name in (asked, expected))
    monkeypatch.setattr(cpu_amx, "copy_fits", lambda nbytes, available=None: fits)
    llm = LLM(str(tiny_llama_path), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 22,
              linear_backend=asked)
    runner = llm.engine.runner
    assert runner.linear_backend == expected
    has_copy = [m.amx_weight is not None for m in runner.model.modules() if isinstance(m, Linear)]
    assert all(has_copy) if expected == BACKEND[kernel] else not any(has_copy)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 17, 301, 44]], params)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("out_features", [128, 96])  # whole 64-column items; 32-column ones
def test_grouped_product_takes_each_experts_rows_through_its_own_weight(kernel, out_features):
    """Experts with no rows, 1, 16 and 17 (the AMX kernel's four-block path for runs of at most
    16 rows and its pair path above), and many: each run of rows equals its own expert's
    product, to bfloat16 rounding."""
    gen = torch.Generator().manual_seed(out_features)
    counts = [0, 1, 16, 17, 40, 5, 0, 33]
    in_features = 96
    weights = torch.randn(len(counts), out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(sum(counts), in_features, generator=gen).bfloat16()
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(counts), 0, out=offsets[1:])
    got = cpu_amx.grouped_linear(x, cpu_amx.pack_experts(weights), offsets, out_features,
                                 kernel=kernel)
    for e, (start, end) in enumerate(itertools.pairwise(offsets.tolist())):
        exact = x[start:end].float() @ weights[e].float().T
        torch.testing.assert_close(got[start:end].float(), exact, rtol=2 ** -7, atol=1e-3)
