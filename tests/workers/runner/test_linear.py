"""The oneDNN projection kernel: same numbers as `F.linear`, picked only where it can run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from workers.runner import cbuild, cpu_amx, linear
from workers.runner.linear import (
    Linear,
    onednn_available,
    onednn_linear,
    onednn_runs,
    pack_weight,
    pick_linear_backend,
)
from workers.runner.model import LlamaModel

CPU, CUDA = torch.device("cpu"), torch.device("cuda")

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="PyTorch built without oneDNN")
needs_onednn_bf16 = pytest.mark.skipif(not onednn_runs(torch.bfloat16),
                                       reason="this CPU cannot run oneDNN bfloat16")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(160, 96, generator=gen)
    b = torch.randn(160, generator=gen) if bias else None
    out = onednn_linear(x, weight, b)
    assert out.shape == (rows, 160)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_onednn_linear_reads_strided_inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 192, generator=gen)[:, ::2]  # every other column: not contiguous
    weight = torch.randn(32, 96, generator=gen)
    torch.testing.assert_close(onednn_linear(x, weight), F.linear(x, weight),
                               rtol=1e-5, atol=1e-4)


@needs_onednn_bf16
def test_onednn_linear_bfloat16():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 192, generator=gen)[:, ::2]
    weight = torch.randn(32, 96, generator=gen)
    xb, wb = x.bfloat16(), weight.bfloat16()
    torch.testing.assert_close(onednn_linear(xb, wb).float(), F.linear(xb, wb).float(),
                               rtol=2e-2, atol=2e-2)


@needs_onednn
def test_onednn_rows_do_not_depend_on_the_rest_of_the_batch():
    """Seeded sampling must not change with batch mates; a row's product must not either."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 576, generator=gen)
    weight = torch.randn(960, 576, generator=gen)
    full = onednn_linear(x, weight)
    for rows in (2, 7, 16, 33):
        assert torch.equal(onednn_linear(x[:rows].contiguous(), weight), full[:rows])


def test_auto_is_onednn_on_cpu_for_float32_and_bfloat16_only(monkeypatch):
    monkeypatch.setattr(linear, "native_bf16", lambda: True)  # emulated bfloat16: below
    monkeypatch.setattr(cpu_amx, "available", lambda: False)  # the tile kernels: below
    monkeypatch.setattr(cpu_amx, "dot_preferred", lambda: False)
    expected = "onednn_packed" if onednn_available() else "torch"
    assert pick_linear_backend("auto", CPU, torch.float32) == expected
    dense = "onednn" if onednn_available() else "torch"
    assert pick_linear_backend("auto", CPU, torch.float32, quantized=True) == dense
    expected_bf16 = "onednn_packed" if onednn_runs(torch.bfloat16) else "torch"
    assert pick_linear_backend("auto", CPU, torch.bfloat16) == expected_bf16
    assert pick_linear_backend("auto", CPU, torch.float64) == "torch"
    assert pick_linear_backend("auto", CUDA, torch.bfloat16) == "torch"
    assert pick_linear_backend("torch", CPU, torch.float32) == "torch"


@pytest.mark.parametrize(
    ("name", "device", "dtype", "match"),
    [
        ("mkl", CPU, torch.float32, "must be one of auto, torch, onednn"),
        ("onednn", CUDA, torch.bfloat16, "needs a CPU device"),
        ("onednn", CPU, torch.float64, "float32 or bfloat16"),
    ],
)
def test_impossible_backends_are_refused(name, device, dtype, match):
    with pytest.raises(ValueError, match=match):
        pick_linear_backend(name, device, dtype)


@needs_onednn
def test_a_cpu_without_bfloat16_falls_back_to_torch(monkeypatch):
    """Simulate an AVX2-only CPU: the trial matmul fails as oneDNN fails there."""
    real = linear.onednn_linear

    def no_bf16(x, weight, bias=None):
        if x.dtype == torch.bfloat16:
            raise RuntimeError("could not create a primitive descriptor for a matmul primitive")
        return real(x, weight, bias)

    monkeypatch.setattr(linear, "onednn_linear", no_bf16)
    monkeypatch.setattr(linear, "native_bf16", lambda: False)
    linear.onednn_runs.cache_clear()
    try:
        # bfloat16 float weights run as float32 matmuls; int8 ones are cast per call
        assert pick_linear_backend("auto", CPU, torch.bfloat16) == "onednn_upcast"
        assert pick_linear_backend("auto", CPU, torch.bfloat16, quantized=True) == "torch"
        assert pick_linear_backend("auto", CPU, torch.float32) == "onednn_packed"
        with pytest.raises(ValueError, match=r"cannot run torch\.bfloat16 on this CPU"):
            pick_linear_backend("onednn", CPU, torch.bfloat16)
    finally:
        linear.onednn_runs.cache_clear()


@needs_onednn
@pytest.mark.parametrize(("amx", "dot", "vendor", "blocked"), [
    (False, False, "AuthenticAMD", "onednn_packed"), (True, True, "GenuineIntel", "amx"),
    (False, True, "AuthenticAMD", "avx512_bf16"), (False, True, "GenuineIntel", "onednn_packed"),
])
def test_a_cpu_with_bfloat16_picks_onednn_amx_or_dot_products_where_they_pay(
        monkeypatch, amx, dot, vendor, blocked):
    """AMX first; then AVX-512 BF16 dot products over the same tile copy on AMD cores, where
    they were measured faster than oneDNN; else oneDNN alone."""
    monkeypatch.setattr(linear, "onednn_linear", lambda x, w, b=None: x @ w.t())
    monkeypatch.setattr(linear, "native_bf16", lambda: True)
    monkeypatch.setattr(cpu_amx, "available", lambda: amx)
    monkeypatch.setattr(cpu_amx, "dot_available", lambda: dot)
    monkeypatch.setattr(cbuild, "cpu_vendor", lambda: vendor)
    linear.onednn_runs.cache_clear()
    try:
        assert pick_linear_backend("auto", CPU, torch.bfloat16) == blocked
        assert pick_linear_backend("auto", CPU, torch.bfloat16, quantized=True) == "onednn"
        assert pick_linear_backend("auto", CPU, torch.float32) == "onednn_packed"
        if amx:
            assert pick_linear_backend("amx", CPU, torch.bfloat16) == "amx"
        else:
            with pytest.raises(ValueError, match="needs bfloat16 and a CPU with AMX"):
                pick_linear_backend("amx", CPU, torch.bfloat16)
        with pytest.raises(ValueError, match="needs bfloat16"):
            pick_linear_backend("amx", CPU, torch.float32)
        if dot:
            assert pick_linear_backend("avx512_bf16", CPU, torch.bfloat16) == "avx512_bf16"
        else:
            with pytest.raises(ValueError, match="a CPU with AVX-512 BF16"):
                pick_linear_backend("avx512_bf16", CPU, torch.bfloat16)
    finally:
        linear.onednn_runs.cache_clear()


def test_native_bf16_reads_the_flags(monkeypatch):
    flags = "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni"
    monkeypatch.setattr(cbuild, "cpu_signature", lambda: flags)
    assert not linear.native_bf16()
    monkeypatch.setattr(cbuild, "cpu_signature", lambda: flags + " avx512_bf16")
    assert linear.native_bf16()


@needs_onednn
def test_a_cpu_that_emulates_bfloat16_runs_it_as_float32_matmuls(monkeypatch):
    """AVX-512 without BF16 (a Xeon whose hypervisor hides it): oneDNN runs bfloat16 there,
    by emulation, 3.5-4.5x slower than float32, so `auto` widens to float32 matmuls."""
    monkeypatch.setattr(linear, "native_bf16", lambda: False)
    monkeypatch.setattr(cpu_amx, "available", lambda: False)
    monkeypatch.setattr(cpu_amx, "dot_preferred", lambda: False)
    assert pick_linear_backend("auto", CPU, torch.bfloat16) == "onednn_upcast"
    assert pick_linear_backend("auto", CPU, torch.float32) == "onednn_packed"
    assert pick_linear_backend("auto", CPU, torch.bfloat16, quantized=True) in ("onednn",
                                                                                "torch")
    assert pick_linear_backend("auto", CUDA, torch.bfloat16) == "torch"
    assert pick_linear_backend("onednn_upcast", CPU, torch.bfloat16) == "onednn_upcast"
    with pytest.raises(ValueError, match="needs bfloat16 float weights"):
        pick_linear_backend("onednn_upcast", CPU, torch.float32)
    with pytest.raises(ValueError, match="needs bfloat16 float weights"):
        pick_linear_backend("onednn_upcast", CPU, torch.bfloat16, quantized=True)
    monkeypatch.setattr(linear, "native_bf16", lambda: True)
    assert pick_linear_backend("auto", CPU, torch.bfloat16) != "onednn_upcast"


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_linear_is_a_bfloat16_matmul_with_float32_sums(bias):
    """Widened inputs and weights (exact), float32 sums, one rounding to bfloat16."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 576, generator=gen).bfloat16()
    weight = torch.randn(960, 576, generator=gen).bfloat16()
    b = torch.randn(960, generator=gen).bfloat16() if bias else None
    out = linear.upcast_linear(x, pack_weight(weight.float()),
                               None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == (37, 960)
    exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
    # within bfloat16's rounding of the result (2^-8 relative) plus float32 sums
    assert torch.all((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3)


@needs_onednn
def test_upcast_packing_keeps_float32_copies_and_float32_logits():
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    model = LlamaModel(config, max_positions=64).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    dense_mlp = model.layers[0].mlp(x, None)
    exact_logits = x.float() @ model.embed_tokens.weight.float().t()
    model.use_linear_kernel(linear.linear_kernel("onednn_upcast"))
    model.pack_linears(upcast=True)
    mlp = model.layers[0].mlp
    assert mlp.gate_up_proj.weight.is_mkldnn and mlp.gate_up_proj.weight.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # lookups stay bfloat16
    out = mlp(x, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, dense_mlp, rtol=2e-2, atol=2e-2)
    logits = model.compute_logits(x)
    assert logits.dtype == torch.float32  # not rounded through bfloat16
    torch.testing.assert_close(logits, exact_logits, rtol=1e-5, atol=1e-5)


def test_use_linear_kernel_routes_every_projection_and_the_tied_head():
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    model = LlamaModel(config, max_positions=64)
    calls: list[tuple[int, ...]] = []

    def counting(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return F.linear(x, weight, bias)

    model.use_linear_kernel(counting)
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(projections) == 2 * 4  # qkv, o, gate_up, down per layer; the head is tied
    assert all(m.kernel is counting for m in projections)
    x = torch.randn(3, 64)
    model.layers[0].mlp(x, None)
    model.compute_logits(x)
    assert calls == [(256, 64), (64, 128), (300, 64)]


@needs_onednn
def test_packed_weights_give_the_plain_product_and_batch_invariant_rows():
    """A weight blocked once (`onednn_packed`) gives oneDNN's product on the dense weight,
    and a row's result does not depend on its batch mates, from 2 rows up."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 576, generator=gen)
    weight = torch.randn(960, 576, generator=gen)
    packed = pack_weight(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    full = onednn_linear(x, packed)
    torch.testing.assert_close(full, onednn_linear(x, weight), rtol=1e-5, atol=1e-4)
    for rows in (2, 7, 16, 33):
        assert torch.equal(onednn_linear(x[:rows].contiguous(), packed), full[:rows])


@needs_onednn
def test_packing_gives_a_tied_head_its_own_blocked_copy_and_the_same_logits():
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    model = LlamaModel(config, max_positions=64)
    model.use_linear_kernel(onednn_linear)
    x = torch.randn(5, 64)
    dense = model.compute_logits(x)
    assert model.head_weight is None
    model.pack_linears()
    assert model.head_weight is not None and model.head_weight.is_mkldnn
    assert not model.embed_tokens.weight.is_mkldnn  # lookups still read the dense table
    torch.testing.assert_close(model.compute_logits(x), dense, rtol=1e-5, atol=1e-4)
