"""Mixture-of-experts families (Qwen3-MoE, Mixtral): the routed experts against a naive
per-token reference and against HF's own block, the engine against HF's forward (renormalised
routing, dense layers beside sparse ones), and what is refused by name (LoRA on the experts,
int8 weights). The families' greedy, mixed-length, prefix-hit and sliding-window runs are in
test_families.py with every other family."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.workers.lora.helpers import make_peft_adapter, peft_model
from tests.workers.runner.models.families import (
    WINDOWED,
    assert_greedy_like_hf,
    build_family,
    random_prompts,
)
from tests.workers.runner.models.test_loading import rewrite_weights
from workers import LLM, SamplingParams
from workers.lora.adapter import AdapterError
from workers.runner import cpu_amx, cpu_moe
from workers.runner.cpu_fused import pick_elementwise
from workers.runner.models import family_of
from workers.runner.models import weights as weights_module
from workers.runner.models.experts import SparseMoE, grouped_mm_runs, routed_experts
from workers.runner.models.layers import MLP

CPU32 = {"device": "cpu", "dtype": "float32"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
KERNELS = ["loop", pytest.param("grouped", marks=pytest.mark.skipif(
    not grouped_mm_runs("cpu", torch.float32), reason="this torch has no CPU _grouped_mm"))]


def naive_experts(x, weights, experts, gate_up, down):
    """One token at a time, one of its experts at a time."""
    n = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = int(experts[t, k])
            gate, up = (gate_up[e] @ x[t]).split(n)
            out[t] += weights[t, k] * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["torch-sum", "c-sum"])
@pytest.mark.parametrize("kernel", [*KERNELS, pytest.param("vec", marks=pytest.mark.skipif(
    not cpu_moe.available(), reason="the MoE kernel does not build here"))])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_routed_experts_equal_a_per_token_reference(kernel, tokens, fused):
    """Every (token, expert) pair lands on its token with its weight, whatever the experts'
    loads (some get none: 6 experts, top 2, few tokens); the pairs summed back by PyTorch's
    gather and batched matmul, or by the C kernel (`cpu_fused.moe_sum`)."""
    if fused and pick_elementwise("auto", torch.device("cpu"), torch.float32) != "cpu":
        pytest.skip("the C element-wise kernels do not build here")
    torch.manual_seed(tokens)
    num_experts, hidden, inter, top_k = 6, 16, 8, 2
    x = torch.randn(tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * inter, hidden)
    down = torch.randn(num_experts, hidden, inter)
    experts = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)

    def activate(h):
        gate, up = h.split(inter, dim=-1)
        return F.silu(gate) * up

    tiles = None
    if kernel == "vec":  # float32 experts packed for the C kernel
        tiles = (cpu_moe.pack_experts(gate_up), cpu_moe.pack_experts(down))
    got = routed_experts(x, weights, experts, gate_up, down, activate, kernel=kernel,
                         fused=fused, tiles=tiles)
    want = naive_experts(x, weights, experts, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_amx_hands_few_rows_to_dot_products(monkeypatch):
    """With AMX, a step of fewer than 2 pairs per expert on average goes to the AVX-512 BF16
    kernel over the same packed weights (tiles of 16 rows would sit mostly empty)."""
    if not (cpu_amx.kernel_available("amx") and cpu_amx.kernel_available("dot")):
        pytest.skip("no AMX here")
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2)
    arch = family_of({"model_type": "qwen3_moe"}).arch(config)
    block = arch.mlp(arch, 0).to(torch.bfloat16)
    block.pack_experts("amx")
    used = []
    real = cpu_amx.grouped_linear
    monkeypatch.setattr(cpu_amx, "grouped_linear",
                        lambda *a, kernel, **k: used.append(kernel) or real(*a, kernel=kernel,
                                                                            **k))
    with torch.no_grad():
        block(torch.randn(7, 64, dtype=torch.bfloat16), None)  # 14 pairs, 8 experts
        block(torch.randn(8, 64, dtype=torch.bfloat16), None)  # 16
    assert used == ["dot", "dot", "amx", "amx"]


@pytest.mark.parametrize("kernel", cpu_amx.KERNELS)
def test_tile_kernels_take_every_expert_in_one_call(kernel):
    """bfloat16 experts packed in the tile layout (`pack_experts`, as the `amx` and
    `avx512_bf16` linear backends pack them): the block's output is the stacked weights' within
    bfloat16 rounding, and the stacked copy is gone."""
    if not cpu_amx.kernel_available(kernel):
        pytest.skip(f"no {kernel} kernel on this CPU")
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        num_attention_heads=4, num_key_value_heads=2)
    arch = family_of({"model_type": "qwen3_moe"}).arch(config)
    torch.manual_seed(2)
    block = arch.mlp(arch, 0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
    block = block.to(torch.bfloat16)
    x = torch.randn(29, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = block(x, None).float()
        block.pack_experts(kernel)
        assert block.tiles is not None and block.experts.gate_up_proj.weight.numel() == 0
        got = block(x, None).float()
        block.fused = True  # SiLU-and-multiply and the weighted sum by the C kernels
        fused = block(x, None).float()
    for out in (got, fused):
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_upcast_runs_bfloat16_experts_in_float32(family, monkeypatch):
    """`onednn_upcast` (a CPU without bfloat16 dot products): bfloat16 experts are widened
    once and packed for the float32 kernel, the block takes bfloat16 in and gives bfloat16
    out, and its output is the float32 block's on the same (bfloat16-rounded) weights,
    rounded once."""
    if not cpu_moe.available():
        pytest.skip("no C compiler for the float32 MoE kernel")
    import transformers

    config_class = (transformers.Qwen3MoeConfig if family == "qwen3_moe"
                    else transformers.MixtralConfig)
    sizes = ({"moe_intermediate_size": 32, "num_experts": 8} if family == "qwen3_moe"
             else {"intermediate_size": 32, "num_local_experts": 8})
    config = config_class(hidden_size=64, num_experts_per_tok=2, num_attention_heads=4,
                          num_key_value_heads=2, **sizes)
    arch = family_of({"model_type": family}).arch(config)
    torch.manual_seed(5)
    block = arch.mlp(arch, 0)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
    block = block.to(torch.bfloat16)
    reference = copy.deepcopy(block).float()  # the same rounded weights, all in float32
    x = torch.randn(23, 64, dtype=torch.bfloat16)
    calls = []
    real = cpu_moe.grouped_linear
    monkeypatch.setattr(cpu_moe, "grouped_linear",
                        lambda rows, *a, **k: calls.append(rows.dtype) or real(rows, *a, **k))
    with torch.no_grad():
        block.pack_experts(None, upcast=True)
        assert block.kernel == "vec" and block.upcast
        assert block.experts.gate_up_proj.weight.numel() == 0
        got = block(x, None)
        want = reference(x.float(), None)
    assert got.dtype == torch.bfloat16 and calls == [torch.float32, torch.float32]
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize(("family", "norm"), [("qwen3_moe", True), ("qwen3_moe", False),
                                              ("mixtral", True)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_block_equals_hfs(family, norm, kernel):
    """Our block with HF's block's weights gives its output: routing (softmax, top-k, the
    renormalisation) and the experts' names and rows as the loader would place them."""
    import transformers

    hidden, inter = 32, 24
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=norm, num_attention_heads=4,
            num_key_value_heads=2)
        block_cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    else:
        config = transformers.MixtralConfig(
            hidden_size=hidden, intermediate_size=inter, num_local_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
        block_cls = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
    torch.manual_seed(1)
    theirs = block_cls(config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0, 0.5)
    arch = family_of({"model_type": family}).arch(config)
    ours = arch.mlp(arch, 0)
    assert isinstance(ours, SparseMoE)
    ours.kernel = kernel
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.experts.gate_up_proj.weight.copy_(theirs.experts.gate_up_proj)
        ours.experts.down_proj.weight.copy_(theirs.experts.down_proj)
    x = torch.randn(1, 37, hidden)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0], None), theirs(x)[0], rtol=1e-5, atol=1e-5)


def test_qwen3_moe_renormalised_with_dense_layers_matches_hf(tmp_path, tokenizer):
    """norm_topk_prob on; `decoder_sparse_step` 2 and `mlp_only_layers` [1]: layer 0 and 1
    dense, 2 sparse (test_families covers norm_topk_prob off, every other layer sparse)."""
    hf = build_family(tmp_path, tokenizer, "qwen3_moe", norm_topk_prob=True,
                      num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[1])
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, max_num_batched_tokens=32,
              block_size=16, **CPU32)
    kinds = [type(layer.mlp) for layer in llm.engine.runner.model.layers]
    assert kinds == [MLP, MLP, MLP, SparseMoE]
    prompts = random_prompts(5, seed=7, lo=3, hi=60)
    assert_greedy_like_hf(hf, prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)])


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_moe_on_torch_paths_and_the_loop_kernel(tmp_path, tokenizer, family):
    """PyTorch's projections, element-wise ops and attention (the CUDA fallbacks, gpt-oss's
    sinks in the torch decode groups and masked prefill, past its window): the experts stay
    stacked (nothing is packed) and run as one matmul per expert."""
    hf = build_family(tmp_path, tokenizer, family, **WINDOWED.get(family, {}))
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, max_num_batched_tokens=24, block_size=8,
              linear_backend="torch", elementwise="torch", attention_backend="torch",
              prefill_attention="masked", **CPU32)
    for layer in llm.engine.runner.model.layers:
        assert layer.mlp.tiles is None
        layer.mlp.kernel = "loop"
    prompts = random_prompts(4, seed=3, lo=5, hi=50)
    assert_greedy_like_hf(hf, prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)])


def test_float32_experts_are_packed_for_the_c_kernel(tmp_path, tokenizer):
    """The default CPU backend packs float32 experts once for `cpu_moe` (`vec`): the stacked
    copy is gone and the tokens are HF's."""
    if not cpu_moe.available():
        pytest.skip("the MoE kernel does not build here")
    hf = build_family(tmp_path, tokenizer, "qwen3_moe")
    llm = LLM(str(tmp_path), kv_cache_memory=8 << 20, **CPU32)
    sparse = [layer.mlp for layer in llm.engine.runner.model.layers
              if isinstance(layer.mlp, SparseMoE)]
    assert sparse and all(m.kernel == "vec" and m.experts.gate_up_proj.weight.numel() == 0
                          for m in sparse)
    prompts = random_prompts(4, seed=8, lo=5, hi=50)
    assert_greedy_like_hf(hf, prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)])


def test_lora_on_attention_equals_peft_and_expert_targets_are_refused(tmp_path, tokenizer):
    build_family(tmp_path / "base", tokenizer, "qwen3_moe")
    adapter = make_peft_adapter(tmp_path / "base", tmp_path / "lora", seed=3, r=8,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    reference = peft_model(tmp_path / "base", adapter)
    llm = LLM(str(tmp_path / "base"), kv_cache_memory=8 << 20, enable_lora=True,
              max_lora_rank=8, **CPU32)
    llm.add_lora("a", str(adapter))
    prompts = random_prompts(4, seed=5)
    mixed = llm.generate(prompts, GREEDY, lora=["a", None, "a", None])
    adapted = [o.token_ids for o in mixed[0::2]]
    assert_greedy_like_hf(reference, prompts[0::2], adapted)
    assert adapted != [o.token_ids for o in llm.generate(prompts[0::2], GREEDY)]
    # peft (on transformers 5) adapts the experts' fused 3-d weights: an adapter naming MLP
    # modules is refused by name before its tensors are read
    mlp = shutil.copytree(adapter, tmp_path / "mlp")
    config = json.loads((mlp / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "gate_proj", "up_proj"]
    (mlp / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"unsupported target modules on qwen3_moe models: "
                                           r"gate_proj, up_proj \(supported: .*q_proj"):
        llm.add_lora("b", str(mlp))


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_int8_is_refused_by_family_before_any_weight_is_read(tmp_path, tokenizer,
                                                             monkeypatch, family):
    build_family(tmp_path, tokenizer, family)
    monkeypatch.setattr(weights_module, "safe_open", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(ValueError, match=rf"{family}: quantization 'int8' is not served on "
                                         r"mixture-of-experts experts"):
        LLM(str(tmp_path), kv_cache_memory=4 << 20, quantization="int8", **CPU32)


@pytest.mark.parametrize(("family", "name"), [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ("qwen3_moe", "model.layers.0.mlp.experts.7.up_proj.weight"),
])
def test_a_missing_expert_is_named_as_the_checkpoint_names_it(tmp_path, tokenizer, family,
                                                               name):
    build_family(tmp_path, tokenizer, family)
    rewrite_weights(tmp_path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"lacks weights: '{name}'".replace(".", r"\.")):
        LLM(str(tmp_path), kv_cache_memory=4 << 20, **CPU32)


@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])
def test_float32_kernel_on_each_cpu_target(march):
    """`cpu_moe` built for AVX-512 (native here), AVX2 and SSE2: each expert's run of rows
    times its weight, experts without rows included, column counts not a whole register
    tile (48 = 3 blocks)."""
    try:
        cpu_moe.load_library(march)
    except RuntimeError as exc:
        pytest.skip(f"cannot build for {march}: {exc}")
    torch.manual_seed(4)
    weights = torch.randn(5, 48, 40)
    offsets = torch.tensor([0, 3, 3, 17, 18, 25])
    x = torch.randn(25, 40)
    got = cpu_moe.grouped_linear(x, cpu_moe.pack_experts(weights, march=march), offsets, 48,
                                 march=march)
    want = torch.cat([x[offsets[e]:offsets[e + 1]] @ weights[e].T for e in range(5)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
