"""The AMX bfloat16 matmul: its product, its row independence, the model's choice of it by
rows, and the build for CPUs without AMX (which answers "not available")."""

from __future__ import annotations

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


def test_a_build_without_amx_refuses_every_call():
    """The x86-64-v3 (AVX2) target builds on any x86 machine with a compiler."""
    lib = cpu_amx.load_library("x86-64-v3")
    assert lib.amx_init() == -1
    w = torch.zeros(32, 32, dtype=torch.bfloat16)
    assert lib.amx_pack(w.data_ptr(), w.data_ptr(), 32, 32) == -1
    assert lib.amx_gemm(w.data_ptr(), w.data_ptr(), w.data_ptr(), 1, 32, 32, 32, 32, 0, 1) == -1


def test_fits_and_packable():
    assert cpu_amx.packable(torch.zeros(64, 96, dtype=torch.bfloat16))
    assert not cpu_amx.packable(torch.zeros(48, 96, dtype=torch.bfloat16))  # 48 % 32
    assert not cpu_amx.packable(torch.zeros(64, 96))  # float32
    assert cpu_amx.fits(torch.zeros(3, 5, 96, dtype=torch.bfloat16))
    assert not cpu_amx.fits(torch.zeros(cpu_amx.MAX_ROWS + 1, 96, dtype=torch.bfloat16))
    assert not cpu_amx.fits(torch.zeros(4, 96))
    assert not cpu_amx.fits(torch.zeros(96, 4, dtype=torch.bfloat16).t())


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 64, 100, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (64, 1536)])
def test_product_is_the_float32_sum_of_bfloat16_inputs(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    exact = x.float() @ w.float().T
    packed = cpu_amx.pack(w)
    got32 = cpu_amx.amx_linear(x, packed, out_features, out_dtype=torch.float32)
    torch.testing.assert_close(got32, exact, rtol=1e-5, atol=1e-4)
    got = cpu_amx.amx_linear(x, packed, out_features)
    assert got.dtype == torch.bfloat16
    # sums in another order round to a neighbouring bfloat16 at most
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=1e-3)


@needs_amx
def test_a_row_does_not_depend_on_its_batch_mates_or_stride():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(192, 256, generator=gen).bfloat16()
    wide = torch.randn(70, 320, generator=gen).bfloat16()
    x = wide[:, :256]  # rows 320 apart
    packed = cpu_amx.pack(w)
    full = cpu_amx.amx_linear(x, packed, 192)
    assert torch.equal(full, cpu_amx.amx_linear(x.contiguous(), packed, 192))
    for rows in (1, 15, 33):
        assert torch.equal(cpu_amx.amx_linear(x[:rows], packed, 192), full[:rows])


@needs_amx
def test_the_model_uses_amx_for_few_rows_and_onednn_for_many(monkeypatch):
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaModel(config, max_positions=64).to(torch.bfloat16)
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.use_linear_kernel(linear_kernel("amx"))
    model.pack_linears(amx=True)
    calls: list[int] = []
    real = cpu_amx.amx_linear

    def counting(x, packed, out_features, **kw):
        calls.append(x.shape[0])
        return real(x, packed, out_features, **kw)

    monkeypatch.setattr(cpu_amx, "amx_linear", counting)
    mlp = model.layers[0].mlp
    for rows in (4, cpu_amx.MAX_ROWS + 1):
        calls.clear()
        x = torch.randn(rows, 64).bfloat16()
        gate_up = F.linear(x.float(), dense["layers.0.mlp.gate_up_proj.weight"].float())
        torch.testing.assert_close(mlp.gate_up_proj(x).float(), gate_up, rtol=2 ** -7,
                                   atol=1e-2)
        logits = x.float() @ dense["embed_tokens.weight"].float().T
        few = rows <= cpu_amx.MAX_ROWS  # AMX gives the head's float32 sums unrounded
        torch.testing.assert_close(model.compute_logits(x), logits,
                                   rtol=1e-4 if few else 2 ** -7, atol=1e-3 if few else 1e-2)
        assert calls == ([rows, rows] if rows <= cpu_amx.MAX_ROWS else [])


def test_the_copy_may_take_a_quarter_of_the_memory_available():
    assert cpu_amx.copy_fits(100, available=400)
    assert not cpu_amx.copy_fits(101, available=400)
    assert cpu_amx.copy_fits(1 << 20)  # this machine has more than 4 MiB free


@needs_amx
@pytest.mark.parametrize(("asked", "fits", "expected"), [
    ("auto", True, "amx"), ("auto", False, "onednn_packed"), ("amx", False, "amx"),
])
def test_auto_skips_the_amx_copy_where_memory_is_short(tiny_llama_path, monkeypatch, asked,
                                                       fits, expected):
    monkeypatch.setattr(cpu_amx, "copy_fits", lambda nbytes, available=None: fits)
    llm = LLM(str(tiny_llama_path), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 22,
              linear_backend=asked)
    runner = llm.engine.runner
    assert runner.linear_backend == expected
    has_copy = [m.amx_weight is not None for m in runner.model.modules() if isinstance(m, Linear)]
    assert all(has_copy) if expected == "amx" else not any(has_copy)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 17, 301, 44]], params)[0].outputs[0].token_ids) == 4
