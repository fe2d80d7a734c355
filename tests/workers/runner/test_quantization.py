"""Weight-only int8: the kernel computes exactly the dequantized product, the model keeps a
quarter of the bytes, and the engine on int8 weights equals the engine on a float checkpoint
whose weights already lie on the int8 grid (quantizing those again changes nothing), LoRA
rows included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.devices import DEVICES, exact
from tests.workers.lora.helpers import ALL_MODULES, make_peft_adapter
from workers import LLM, SamplingParams
from workers.runner import quantization
from workers.runner.linear import onednn_available, onednn_linear, onednn_runs
from workers.runner.quantization import (
    Int8Embedding,
    Int8Linear,
    int8_linear,
    pick_int8_compute,
    quantize,
    quantize_per_channel,
    weight_bytes,
)

CPU = torch.device("cpu")
needs_onednn_bf16 = pytest.mark.skipif(not onednn_runs(torch.bfloat16),
                                       reason="oneDNN cannot run bfloat16 on this CPU")

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_per_channel_round_trip_is_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 80, generator=gen) * torch.rand(48, 1, generator=gen) * 3
    weight[5] = 0  # an all-zero channel keeps a usable scale
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert int(q.abs().max()) == 127
    error = (q.float() * scale[:, None] - weight).abs()
    assert torch.all(error <= scale[:, None] / 2 + 1e-6)
    assert torch.all(q[5] == 0) and scale[5] == 1


@pytest.mark.parametrize("tile_bytes", [1 << 30, 64 * 40 * 4])  # one tile; several, uneven
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_the_dequantized_product(monkeypatch, tile_bytes, rows, bias):
    monkeypatch.setattr(quantization, "CPU_TILE_BYTES", tile_bytes)
    gen = torch.Generator().manual_seed(rows)
    q, scale = quantize_per_channel(torch.randn(200, 40, generator=gen))
    x = torch.randn(rows, 40, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    expected = F.linear(x, q.float() * scale[:, None], b)
    torch.testing.assert_close(int8_linear(x, q, scale, b), expected, rtol=1e-5, atol=1e-4)
    if onednn_available():
        torch.testing.assert_close(int8_linear(x, q, scale, b, onednn_linear), expected,
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_linear_on_cuda_is_the_dequantized_product(rows, dtype):
    """On CUDA the int8 weight is cast whole to the activations' dtype for one matmul, then
    scaled in float32."""
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(rows)
    q, scale = quantize_per_channel(torch.randn(200, 40, generator=gen))
    x = torch.randn(rows, 40, generator=gen)
    b = torch.randn(200, generator=gen)
    expected = F.linear(x.to(dtype).float(), q.float() * scale[:, None], b)
    got = int8_linear(x.to(cuda, dtype), q.to(cuda), scale.to(cuda), b.to(cuda, dtype))
    assert got.dtype == dtype and got.device.type == "cuda"
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2,
                                                                       "atol": 5e-2}
    torch.testing.assert_close(got.float().cpu(), expected, **tol)


def test_half_precision_output_is_scaled_in_float32():
    gen = torch.Generator().manual_seed(4)
    q, scale = quantize_per_channel(torch.randn(64, 48, generator=gen) * 5)
    x = torch.randn(9, 48, generator=gen).bfloat16()
    got = int8_linear(x, q, scale, None)
    assert got.dtype == torch.bfloat16 and scale.dtype == torch.float32
    expected = F.linear(x.float(), q.float() * scale[:, None])
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [quantization.GEMV_ROWS + 1, 64])
def test_bfloat16_compute_rounds_only_the_activations(rows):
    """int8 values are exact in bfloat16: the product equals the float one of the rounded
    activations, up to bfloat16 output rounding, and comes back in the input's float32."""
    gen = torch.Generator().manual_seed(rows)
    q, scale = quantize_per_channel(torch.randn(96, 64, generator=gen))
    assert torch.equal(q.to(torch.bfloat16).float(), q.float())
    x = torch.randn(rows, 64, generator=gen)
    b = torch.randn(96, generator=gen)
    expected = F.linear(x.bfloat16().float(), q.float() * scale[:, None], b)
    kernels = [F.linear] + ([onednn_linear] if onednn_runs(torch.bfloat16) else [])
    for kernel in kernels:
        got = int8_linear(x, q, scale, b, kernel, torch.bfloat16)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=8e-3, atol=8e-3)
        assert not torch.equal(got, F.linear(x, q.float() * scale[:, None], b))  # it did round


@pytest.mark.parametrize("compute", [None, torch.bfloat16])
def test_few_rows_are_read_as_int8_in_float32(monkeypatch, compute):
    """Up to GEMV_ROWS float32 rows go through the int8 kernel (no cast, float32 sums,
    whatever `compute` says); one more row goes back to casting."""
    from workers.runner import cpu_int8

    calls = []
    real = cpu_int8.int8_gemv
    monkeypatch.setattr(cpu_int8, "int8_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(9)
    q, scale = quantize_per_channel(torch.randn(70, 48, generator=gen))
    b = torch.randn(70, generator=gen)
    for rows in range(1, quantization.GEMV_ROWS + 1):
        x = torch.randn(rows, 48, generator=gen)
        expected = F.linear(x, q.float() * scale[:, None], b)
        torch.testing.assert_close(int8_linear(x, q, scale, b, F.linear, compute), expected,
                                   rtol=1e-5, atol=1e-5)
    assert len(calls) == quantization.GEMV_ROWS
    int8_linear(torch.randn(quantization.GEMV_ROWS + 1, 48), q, scale, b, F.linear, compute)
    assert len(calls) == quantization.GEMV_ROWS


def test_int8_compute_is_picked_by_cpu_flags(monkeypatch):
    monkeypatch.setattr(quantization, "onednn_runs", lambda dtype: True)
    monkeypatch.setattr(quantization, "native_bf16", lambda: True)
    assert pick_int8_compute("auto", CPU, torch.float32) == torch.bfloat16
    assert pick_int8_compute("auto", CPU, torch.float16) == torch.float16  # not a float32 model
    assert pick_int8_compute("auto", torch.device("cuda"), torch.float32) == torch.float32
    assert pick_int8_compute("model", CPU, torch.float32) == torch.float32
    monkeypatch.setattr(quantization, "native_bf16", lambda: False)  # emulated: slower than f32
    assert pick_int8_compute("auto", CPU, torch.float32) == torch.float32
    assert pick_int8_compute("bfloat16", CPU, torch.float32) == torch.bfloat16  # asked for
    monkeypatch.setattr(quantization, "onednn_runs", lambda dtype: False)
    with pytest.raises(ValueError, match="cannot run on this CPU"):
        pick_int8_compute("bfloat16", CPU, torch.float32)
    with pytest.raises(ValueError, match="int8_compute must be one of"):
        pick_int8_compute("int4", CPU, torch.float32)


def test_int8_compute_is_probed_only_for_int8_weights(tiny_llama_path, monkeypatch):
    """Without int8 weights the setting is checked by name but asks nothing of the CPU."""
    monkeypatch.setattr(quantization, "onednn_runs", lambda dtype: False)
    llm = LLM(str(tiny_llama_path), kv_cache_memory=4 << 20, int8_compute="bfloat16")
    assert not any(isinstance(m, Int8Linear) for m in llm.engine.runner.model.modules())
    with pytest.raises(ValueError, match="int8_compute"):  # EngineArgs names the setting
        LLM(str(tiny_llama_path), kv_cache_memory=4 << 20, int8_compute="int4")
    with pytest.raises(ValueError, match="cannot run on this CPU"):
        LLM(str(tiny_llama_path), kv_cache_memory=4 << 20, quantization="int8",
            int8_compute="bfloat16")


def _tiny_model(tiny_llama_path: Path, tie: bool = True):
    from transformers import AutoConfig

    from workers.runner.loader import load_weights
    from workers.runner.model import LlamaModel

    config = AutoConfig.from_pretrained(tiny_llama_path)
    model = LlamaModel(config, 64).requires_grad_(False)
    load_weights(model, tiny_llama_path)
    if not tie:  # an untied head of its own, to cover that branch too
        config.tie_word_embeddings = False
        untied = LlamaModel(config, 64).requires_grad_(False)
        untied.load_state_dict(model.state_dict(), strict=False)
        untied.lm_head.weight.copy_(model.embed_tokens.weight.flip(0))
        model = untied
    return model.eval()


@pytest.mark.parametrize("tie", [True, False])
def test_quantized_model_keeps_a_quarter_of_the_bytes(tiny_llama_path, tie):
    model = _tiny_model(tiny_llama_path, tie)
    float_bytes = weight_bytes(model)
    quantize(model, "int8", "torch")
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * model.config.num_hidden_layers + 1  # and the LM head
    assert isinstance(model.embed_tokens, Int8Embedding)
    assert weight_bytes(model) <= 0.3 * float_bytes
    # the model's parameters are the float ones left (norms): what the runner reads its dtype
    # and device from
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_quantization_names_are_checked(tiny_llama_path):
    model = _tiny_model(tiny_llama_path)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize(model, "int4", "torch")
    with pytest.raises(ValueError, match="onednn_packed"):
        quantize(model, "int8", "onednn_packed")
    quantize(model, "none", "torch")
    assert not any(isinstance(m, Int8Linear) for m in model.modules())


def on_int8_grid(source: Path, out: Path) -> Path:
    """The checkpoint with every matrix quantized and dequantized (norms untouched)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                q, scale = quantize_per_channel(param)
                param.copy_(q.float() * scale[:, None])
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def grid_llama(tmp_path_factory, tiny_llama_path) -> Path:
    return on_int8_grid(tiny_llama_path, tmp_path_factory.mktemp("grid-llama"))


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (5, 17, 40, 9)]


@pytest.mark.parametrize("device", DEVICES)
def test_int8_engine_equals_float_on_grid_weights(grid_llama, device):
    """With float32 matmuls (`int8_compute: model`) int8 weights on the grid are exact."""
    float_llm = LLM(str(grid_llama), kv_cache_memory=8 << 20, **exact(device))
    int8_llm = LLM(str(grid_llama), kv_cache_memory=8 << 20, quantization="int8",
                   int8_compute="model", **exact(device))
    assert any(isinstance(m, Int8Linear) for m in int8_llm.engine.runner.model.modules())
    expected = [o.token_ids for o in float_llm.generate(prompts(), PARAMS)]
    assert [o.token_ids for o in int8_llm.generate(prompts(), PARAMS)] == expected


@needs_onednn_bf16
def test_int8_engine_in_bfloat16_matmuls(grid_llama):
    """Every projection and the head multiply in bfloat16; the model, its norms and the
    logits stay float32, and the logits stay near the float ones."""
    from workers.runner.perplexity import perplexity

    float_llm = LLM(str(grid_llama), kv_cache_memory=8 << 20)
    llm = LLM(str(grid_llama), kv_cache_memory=8 << 20, quantization="int8",
              int8_compute="bfloat16")
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m.compute == torch.bfloat16 for m in linears)
    assert llm.engine.runner.dtype == torch.float32
    ids = [i for p in prompts() for i in p]
    got, expected = (perplexity(x.engine.runner, ids) for x in (llm, float_llm))
    assert got == pytest.approx(expected, rel=0.01)
    assert len(llm.generate(prompts(), PARAMS)[0].token_ids) == PARAMS.max_tokens


@pytest.mark.parametrize("device", DEVICES)
def test_int8_engine_with_lora_rows_equals_float(grid_llama, tmp_path, device):
    adapter = make_peft_adapter(grid_llama, tmp_path / "lora", seed=1, r=8,
                                target_modules=ALL_MODULES)
    outs = []
    for quant in ("none", "int8"):
        llm = LLM(str(grid_llama), kv_cache_memory=8 << 20, enable_lora=True,
                  quantization=quant, int8_compute="model", **exact(device))
        llm.add_lora("a", str(adapter))
        mixed = llm.generate(prompts(), PARAMS, lora=["a", None, "a", None])
        outs.append([o.token_ids for o in mixed])
    assert outs[0] == outs[1]
