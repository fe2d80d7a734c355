"""gpt-oss: attention sinks on every attention path (the C decode kernel against the float64
reference and the torch path, the torch paths, the routing of sink layers away from kernels
without a sink term), the clamped-SwiGLU experts with biases against HF's block, YaRN against
HF's rotary tables, MXFP4 experts dequantized at load, and what is refused by name. Greedy
runs against HF's forward (mixed lengths, chunked prefill, prefix-cache hits, prompts past a
window of 8) are in test_families.py with every other family."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.workers.lora.helpers import make_peft_adapter
from tests.workers.runner.conftest import build_targets
from tests.workers.runner.models.families import (
    FAMILIES,
    WINDOWED,
    assert_greedy_like_hf,
    build_family,
    random_prompts,
)
from workers import LLM, SamplingParams
from workers.lora.adapter import AdapterError
from workers.runner import cpu_decode, cpu_moe
from workers.runner.attention import (
    build_metadata,
    paged_attention,
    reference_attention,
    write_kv,
)
from workers.runner.models import family_of, mxfp4
from workers.runner.models import weights as weights_module
from workers.runner.models.experts import grouped_mm_runs
from workers.runner.models.gpt_oss import ClampedSwiGLUExperts
from workers.runner.rope import RotaryEmbedding

CPU32 = {"device": "cpu", "dtype": "float32"}
WINDOW = WINDOWED["gpt_oss"]["sliding_window"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def gpt_oss_config(**overrides):
    import transformers

    return transformers.GptOssConfig(**{
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        **FAMILIES["gpt_oss"][1], **overrides})


def sinks_for(heads: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2


# -- attention sinks ---------------------------------------------------------------------------

def random_pool(num_blocks: int, kv_heads: int, block_size: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g),
            torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g))


@pytest.mark.parametrize("head_dim", [64, 24])  # AVX-512 grouped path, plain loops
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("march", build_targets())
@pytest.mark.parametrize("window", [None, 5])
def test_c_decode_kernel_with_sinks_equals_the_reference(head_dim, plain, march, window):
    """Each row's softmax starts from its head's sink: every code path of every build, with
    and without a window, GQA groups of 2 and tasks that split heads (40 heads of 20 KV)."""
    if not cpu_decode.available():
        pytest.skip("the C decode kernel does not build here")
    for heads, kv_heads in ((6, 3), (40, 20)):
        block_size = 4
        k_cache, v_cache = random_pool(30, kv_heads, block_size, head_dim, seed=head_dim)
        g = torch.Generator().manual_seed(heads)
        lens = [1, 7, 23]
        tables = torch.randperm(30, generator=g)[:18].view(3, 6).to(torch.int32).contiguous()
        q = torch.randn(3, heads, head_dim, generator=g) * 2
        sinks = sinks_for(heads, seed=heads)
        scale = head_dim**-0.5
        out = cpu_decode.paged_decode(q, k_cache, v_cache, tables,
                                      torch.tensor(lens, dtype=torch.int32), scale, block_size,
                                      window=window, sinks=sinks, plain=plain, march=march)
        seqs = [(r, 1, n - 1, tables[r].tolist()) for r, n in enumerate(lens)]
        want = reference_attention(q, k_cache, v_cache, seqs, block_size, scale,
                                   window=window, sinks=sinks)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        plain_softmax = reference_attention(q, k_cache, v_cache, seqs, block_size, scale,
                                            window=window)
        assert not torch.allclose(want, plain_softmax, atol=1e-3)  # the sinks count


@pytest.mark.parametrize("pool", ["int8", "bfloat16"])
def test_c_decode_kernel_sinks_on_int8_and_bfloat16_pools(pool):
    from workers.runner.kv_quant import quantize_rows

    if not cpu_decode.available():
        pytest.skip("the C decode kernel does not build here")
    k_cache, v_cache = random_pool(12, 2, 8, 64, seed=3)
    tables = torch.arange(12, dtype=torch.int32).view(2, 6).contiguous()
    lens = torch.tensor([5, 40], dtype=torch.int32)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(4))
    sinks = sinks_for(4)
    if pool == "int8":
        k_cache = quantize_rows(k_cache.view(-1, 64)).view(12, 2, 8, -1)
        v_cache = quantize_rows(v_cache.view(-1, 64)).view(12, 2, 8, -1)
    else:
        k_cache, v_cache, q = k_cache.bfloat16(), v_cache.bfloat16(), q.bfloat16()
    out = cpu_decode.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, 8, sinks=sinks)
    seqs = [(r, 1, int(n) - 1, tables[r].tolist()) for r, n in enumerate(lens)]
    want = reference_attention(q.float(), k_cache if pool == "int8" else k_cache.float(),
                               v_cache if pool == "int8" else v_cache.float(), seqs, 8, 0.125,
                               sinks=sinks)
    tolerance = 1e-5 if pool == "int8" else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("decode_kernel", [None, "cpu"])
@pytest.mark.parametrize("prefill_kernel", ["flash", "masked", "vec"])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_with_sinks_equals_the_reference(decode_kernel, prefill_kernel,
                                                         window):
    """One step of decodes, a chunk at 0 and a chunk after cached context: the torch decode
    groups or the C kernel, and whatever prefill kernel is asked for (a sink layer's chunks
    take `masked`, the only one with a sink term)."""
    if decode_kernel == "cpu" and not cpu_decode.available():
        pytest.skip("the C decode kernel does not build here")
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    k_cache, v_cache = random_pool(40, kv_heads, bs, dim, seed=5)
    g = torch.Generator().manual_seed(6)
    tables = torch.randperm(40, generator=g).view(5, 8).tolist()
    # (start, q_len): two decodes, a fresh chunk, a chunk after 13 cached positions
    shapes = [(9, 1), (20, 1), (0, 11), (13, 9)]
    seqs = [(start, q_len, tables[i]) for i, (start, q_len) in enumerate(shapes)]
    tokens = sum(q_len for _, q_len in shapes)
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    meta = build_metadata(seqs, bs, kv_heads, heads // kv_heads, torch.device("cpu"),
                          decode_kernel=decode_kernel, prefill_kernel=prefill_kernel)
    write_kv(k_cache, v_cache, k, v, meta.write_rows)
    sinks = sinks_for(heads, seed=7)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, dim**-0.5, bs, window=window,
                          sinks=sinks)
    starts = [0, 1, 2, 13]
    ref_seqs = [(q0, q_len, start, table) for q0, (start, q_len, table)
                in zip(starts, seqs, strict=True)]
    want = reference_attention(q, k_cache, v_cache, ref_seqs, bs, dim**-0.5, window=window,
                               sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_sink_layers_leave_the_triton_kernel_and_the_fused_prefill_kernels():
    """On CUDA the Triton decode kernel has no sink term: a sink layer's decode rows take
    the torch groups there, and its prefill chunks take `masked` whatever the fused kernel;
    the C kernel keeps its rows."""
    seqs = [(9, 1, [0, 1, 2]), (0, 5, [3, 4])]
    for kernel, keeps in (("triton", False), ("cpu", True)):
        meta = build_metadata(seqs, 4, 2, 2, torch.device("cpu"), decode_kernel=kernel,
                              prefill_kernel="flash")
        variant = meta.for_layer(None, None, sinks=True)
        assert (variant.decode_batch is not None) is keeps
        assert bool(variant.decode_groups) is not keeps
        assert variant.prefill_kernel == "masked"
        assert meta.for_layer(None, None).prefill_kernel == "flash"


def test_c_decode_equals_torch_decode_in_the_engine(tmp_path, tokenizer):
    """The same model with the C kernel and with PyTorch's decode groups: equal tokens and
    log-probabilities within float32 rounding, past the window."""
    if not cpu_decode.available():
        pytest.skip("the C decode kernel does not build here")
    build_family(tmp_path, tokenizer, "gpt_oss", **WINDOWED["gpt_oss"])
    prompts = random_prompts(3, seed=4, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    runs = []
    for backend in ("cpu", "torch"):
        llm = LLM(str(tmp_path), kv_cache_memory=4 << 20, block_size=8,
                  attention_backend=backend, **CPU32)
        assert llm.engine.runner.attention_backend == backend
        runs.append(llm.generate(prompts, params))
    for c_run, torch_run in zip(*runs, strict=True):
        assert c_run.token_ids == torch_run.token_ids
        assert [lp.logprob for lp in c_run.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in torch_run.outputs[0].logprobs], abs=1e-4)


# -- experts and RoPE --------------------------------------------------------------------------

KERNELS = ["loop", pytest.param("grouped", marks=pytest.mark.skipif(
    not grouped_mm_runs("cpu", torch.float32), reason="this torch has no CPU _grouped_mm")),
    pytest.param("vec", marks=pytest.mark.skipif(not cpu_moe.available(),
                                                 reason="the MoE kernel does not build here"))]


@pytest.mark.parametrize("fused", [False, True], ids=["torch-sum", "c-sum"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_block_equals_hfs(kernel, fused):
    """Our block with HF's block's checkpoint tensors, converted as the loader converts them
    (transposed, gate and up de-interleaved): router bias, top-k softmax, expert biases and
    both clamps of the SwiGLU (limit 1.5, well inside the values)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = gpt_oss_config()
    torch.manual_seed(1)
    theirs = GptOssMLP(config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0, 0.5)
    arch = family_of({"model_type": "gpt_oss"}).arch(config)
    ours = arch.mlp(arch, 0)
    assert isinstance(ours, ClampedSwiGLUExperts)
    state = {f"experts.{k}": v for k, v in theirs.experts.state_dict().items()}
    state.update({f"router.{k}": v for k, v in theirs.router.state_dict().items()})
    layout = weights_module.checkpoint_layout(ours)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            slot = layout[name.replace("router.", "gate.")]
            params[slot.param].copy_(slot.convert(tensor) if slot.convert else tensor)
    if kernel == "vec":
        ours.pack_experts(None)
        assert ours.kernel == "vec"
    else:
        ours.kernel = kernel
    ours.fused = fused
    x = torch.randn(1, 37, config.hidden_size)
    with torch.no_grad():
        want = theirs(x)[0][0]
        gate_up = x[0] @ theirs.experts.gate_up_proj[0] + theirs.experts.gate_up_proj_bias[0]
        assert (gate_up.abs() > config.swiglu_limit).float().mean() > 0.2  # clamps bind
        torch.testing.assert_close(ours(x[0], None), want, rtol=1e-5, atol=1e-5)


def test_yarn_tables_equal_hfs():
    """gpt-oss's YaRN (factor 32 from 4096 positions, no truncation, its defaults) through
    our rotary tables: HF's cos/sin, attention factor included."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = gpt_oss_config(rope_parameters=None, head_dim=64, max_position_embeddings=131072)
    assert config.rope_parameters["rope_type"] == "yarn"
    ours = RotaryEmbedding(config, 64, 8192)
    positions = torch.tensor([[0, 1, 100, 4095, 4096, 8191]])
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    ours_cos, ours_sin = ours.tables(positions[0])
    torch.testing.assert_close(ours_cos[:, 0], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_sin[:, 0], sin[0], rtol=1e-6, atol=1e-6)


# -- MXFP4 -------------------------------------------------------------------------------------

def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 136, (3, 40, 2), dtype=torch.uint8, generator=g)
    ours = mxfp4.dequantize(blocks, scales)
    assert ours.shape == (3, 64, 40)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    # straight into bfloat16 (a bfloat16 model's load): the same values, exactly, with the
    # rows computed in chunks (`_ROWS` cut to 7 here so several chunks and a short last one)
    wide = torch.randint(0, 256, (2, 23, 3, 16), dtype=torch.uint8, generator=g)
    wide_scales = torch.randint(100, 150, (2, 23, 3), dtype=torch.uint8, generator=g)
    whole = mxfp4.dequantize(wide, wide_scales)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mxfp4, "_ROWS", 7)
        narrow = mxfp4.dequantize(wide, wide_scales, torch.bfloat16)
        assert torch.equal(mxfp4.dequantize(wide, wide_scales), whole)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), whole)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks, scales[:, :, :1])


def test_mxfp4_folder_loads_as_its_dequantized_weights(tmp_path, tokenizer):
    """A folder whose experts are stored as MXFP4 blocks and scales (random codes, packed as
    the released checkpoints pack them) loads to exactly the weights of the same folder with
    the dequantized experts stored plainly, and gives its tokens (which are HF's)."""
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    hf = build_family(plain, tokenizer, "gpt_oss", **WINDOWED["gpt_oss"])
    tensors = load_file(plain / "model.safetensors")
    g = torch.Generator().manual_seed(9)
    quantized = {}
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = tensors[name].shape
            blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16),
                                   dtype=torch.uint8, generator=g)
            # scale 2**-3 .. 2**-1 on FP4 values up to 6: weights of the model's size
            scales = torch.randint(124, 127, (experts, outputs, inputs // 32),
                                   dtype=torch.uint8, generator=g)
            tensors[name] = mxfp4.dequantize(blocks, scales).contiguous()
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(plain, packed)
    save_file({**{k: v for k, v in tensors.items()
                  if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))},
               **quantized}, packed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(config))
    hf.load_state_dict(tensors)

    prompts = random_prompts(3, seed=11, lo=5, hi=40)
    outputs, models = [], []
    for folder in (plain, packed):
        llm = LLM(str(folder), kv_cache_memory=4 << 20, block_size=8, linear_backend="torch",
                  **CPU32)
        models.append(dict(llm.engine.runner.model.named_parameters()))
        outputs.append([o.token_ids for o in llm.generate(prompts, greedy(12))])
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    assert outputs[0] == outputs[1]
    assert_greedy_like_hf(hf, prompts, outputs[0])
    # a bfloat16 model takes the packed experts straight in its dtype: the same weights
    halves = [dict(LLM(str(folder), kv_cache_memory=4 << 20, block_size=8,
                       linear_backend="torch", device="cpu", dtype="bfloat16")
                   .engine.runner.model.named_parameters()) for folder in (plain, packed)]
    assert all(v.dtype == torch.bfloat16 for v in halves[1].values() if v.is_floating_point())
    assert any("experts" in k for k in halves[1])  # the stacked experts among them
    assert all(torch.equal(halves[0][k], halves[1][k]) for k in halves[0])


# -- refused by name ---------------------------------------------------------------------------

def test_another_checkpoint_quantization_is_refused_by_name(tmp_path, tokenizer):
    build_family(tmp_path, tokenizer, "gpt_oss")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gpt_oss: quantization 'bitsandbytes' is not "
                                         r"served \(served: unquantized checkpoints and "
                                         r"'mxfp4' experts"):
        LLM(str(tmp_path), kv_cache_memory=4 << 20, **CPU32)


def test_lora_on_the_experts_is_refused_by_family(tmp_path, tokenizer):
    """An adapter on attention loads; one naming MLP modules is refused, naming the family,
    before its tensors are read."""
    build_family(tmp_path / "base", tokenizer, "gpt_oss")
    adapter = make_peft_adapter(tmp_path / "base", tmp_path / "lora", seed=3, r=4,
                                target_modules=["q_proj", "v_proj"])
    llm = LLM(str(tmp_path / "base"), kv_cache_memory=4 << 20, enable_lora=True,
              max_lora_rank=4, **CPU32)
    llm.add_lora("a", str(adapter))
    mlp = shutil.copytree(adapter, tmp_path / "mlp")
    config = json.loads((mlp / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "gate_up_proj"]
    (mlp / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"unsupported target modules on gpt_oss models: "
                                           r"gate_up_proj \(supported: .*q_proj"):
        llm.add_lora("b", str(mlp))


def test_a_misshapen_stacked_expert_is_named(tmp_path, tokenizer):
    from tests.workers.runner.models.test_loading import rewrite_weights

    build_family(tmp_path, tokenizer, "gpt_oss")
    name = "model.layers.1.mlp.experts.down_proj"

    def cut(tensors):
        tensors[name] = tensors[name][:, :-1].contiguous()

    rewrite_weights(tmp_path, cut)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \(8, 31, 64\) "
                                         r"\(\(8, 64, 31\) in the model's layout\), the model "
                                         r"expects \(8, 64, 32\)".replace(".", r"\.")):
        LLM(str(tmp_path), kv_cache_memory=4 << 20, **CPU32)


# -- engine features ---------------------------------------------------------------------------

def test_speculation_preemption_and_structured_outputs(tmp_path, tokenizer):
    """Prompt-lookup proposals scored in the flattened batch (chunks after cached context,
    through the sink path), and preemption by recompute in a pool too small for the batch,
    give plain greedy's tokens past the window; a grammar masks the vocabulary."""
    from workers.engine.structured import StructuredOutputs

    build_family(tmp_path, tokenizer, "gpt_oss", **WINDOWED["gpt_oss"])
    motif = [1000, 2000, 3000, 4000]
    prompts = [p + motif * 3 for p in random_prompts(6, seed=12, lo=2, hi=20)]
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                              logit_bias={t: 100.0 for t in motif})
    plain = LLM(str(tmp_path), kv_cache_memory=8 << 20, block_size=8, **CPU32)
    want = [o.token_ids for o in plain.generate(prompts, sampling)]
    spec = LLM(str(tmp_path), kv_cache_memory=8 << 20, block_size=8,
               speculative={"method": "ngram", "num_tokens": 4}, **CPU32)
    assert [o.token_ids for o in spec.generate(prompts, sampling)] == want
    assert spec.engine.stats()["spec_accepted_tokens"] > 0
    block_bytes = 3 * 2 * 2 * 8 * 16 * 4  # layers x (K, V) x KV heads x block x head_dim x 4
    tight = LLM(str(tmp_path), kv_cache_memory=14 * block_bytes, block_size=8, **CPU32)
    assert [o.token_ids for o in tight.generate(prompts, sampling)] == want
    assert tight.engine.scheduler.num_preemptions > 0
    choice = SamplingParams(temperature=0.0, max_tokens=40,
                            structured=StructuredOutputs(choice=["yes", "no"]))
    assert plain.generate([[100, 200, 300]], choice)[0].text in ("yes", "no")
