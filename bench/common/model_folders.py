"""The engine benchmarks' model folders: random checkpoints of a named shape
(`--model-config`: llama-1b, qwen3-0.6b, qwen3-moe, family-<name>), and the bytes a folder's
weights and KV cache take.

`build_random_model` writes a folder once into the cache (same shape, same folder); the byte
counts read a folder's config.json and safetensors headers. Nothing heavy is imported at
module level (torch, transformers and the project's `workers` are imported where used), so the
vLLM venv's child can import this module too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

# bumped when build_random_model writes a folder differently (2: a tied head saved tied)
FOLDER_LAYOUT = 2

# Llama-3.2-1B's shape with SmolLM2's vocabulary, so SmolLM2's tokenizer can drive it.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    },
    # Qwen3-0.6B's shape (issue 37), its own 151,936-token vocabulary and tied embeddings;
    # prompts are random ids below SmolLM2's 49,152, and no system detokenises the outputs.
    "qwen3-0.6b": {
        "architecture": "Qwen3ForCausalLM",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    },
    # Qwen3-MoE's shape sized for 2 cores (issue 37): 8 layers, hidden 1024, 16 heads of 128
    # (8 KV), 64 experts of intermediate 256, 8 per token (renormalised), every layer sparse;
    # SmolLM2's vocabulary (49,152, not Qwen's 151,936) so SmolLM2's tokenizer drives it.
    "qwen3-moe": {
        "architecture": "Qwen3MoeForCausalLM",
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "moe_intermediate_size": 256,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    },
}

# One shape for every served family (bench/families.py, issue 37 §7), sized for a 2-core CPU
# (SmolLM2-135M's scale): hidden 512, 12 layers, 8 heads of 64 (4 KV), MLP 1536, SmolLM2's
# vocabulary (its tokenizer drives the workload), embeddings tied in every family so the
# families differ only by their own features. The mixture-of-experts families have 8 experts
# of 1536 / 8 = 192, top 2: the same total parameters as the dense MLP, a quarter active.
FAMILY_SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# family -> (architecture, its distinctive settings over FAMILY_SHAPE), as its real configs set
# them. Sliding windows: Mistral 4,096 on every layer and Gemma 2 4,096 on alternate layers
# never bind on the standard workload (prompt + output <= 768 tokens); Gemma 3's 512 (Gemma 3
# 1B's) on 5 layers of 6 binds on its longer requests, and gpt-oss's 128 on alternate layers
# on most of them. Gemma 3 has no soft-capping (nor do its real configs): q/k norms instead.
FAMILY_FEATURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {  # Llama 3's scaled RoPE (its original context < 8,192)
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 2048}}),
    "mistral": ("MistralForCausalLM", {
        "sliding_window": 4096,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}),
    "qwen2": ("Qwen2ForCausalLM", {  # biases on q, k and v
        "use_sliding_window": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}),
    "qwen3": ("Qwen3ForCausalLM", {  # RMSNorm over each head of q and k
        "attention_bias": False,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}),
    "gemma2": ("Gemma2ForCausalLM", {  # (1 + w) sandwich norms, GELU-tanh, soft-capping
        "query_pre_attn_scalar": 64, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention", "full_attention"] * 6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}),
    "gemma3": ("Gemma3ForCausalLM", {  # Gemma 2's norms, q/k norms, a RoPE base per layer type
        "query_pre_attn_scalar": 64, "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default",
                                               "rope_theta": 1000000.0}}}),
    "phi3": ("Phi3ForCausalLM", {  # fused qkv_proj and gate_up_proj in the checkpoint
        "original_max_position_embeddings": 8192, "sliding_window": None,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {  # q/k norms, experts on every layer
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}),
    "mixtral": ("MixtralForCausalLM", {  # experts of intermediate_size, no window (as 8x7B)
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 192,
        "sliding_window": None,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}),
    # q/k/v/o biases, attention sinks, gpt-oss's window of 128 on alternate layers and its YaRN
    # (factor 32 over an original length of 8,192 / 32, as the real 131,072 / 4,096); experts
    # of intermediate_size with biases and the clamped SwiGLU
    "gpt_oss": ("GptOssForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 192,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 6,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 256}}),
}
MODEL_CONFIGS.update({
    f"family-{family}": {"architecture": architecture, **FAMILY_SHAPE, **features}
    for family, (architecture, features) in FAMILY_FEATURES.items()
})

# The GPU check's shapes (bench/gpu_check.py, issue 41): the real models' configs, weights
# random. SmolLM2-135M as config.json states it; Llama 3.2 1B and Llama 3.1 8B with their
# 128,256-token vocabularies (1B ties its embeddings, 8B does not) and Llama 3 RoPE scaling,
# served up to 8,192 positions. Prompts are SmolLM2's token ids, all below 49,152.
_LLAMA3 = {"rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "vocab_size": 128256}
MODEL_CONFIGS.update({
    "smollm2-135m": {
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    },
    "llama-3.2-1b": {
        **_LLAMA3, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    },
    "llama-3.1-8b": {
        **_LLAMA3, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    },
    # the GPU check's --tiny shape (its CPU tests): a Llama of 2 layers, SmolLM2's vocabulary
    "gpu-check-tiny": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    },
})


def model_dtype_name(device: str) -> str:
    """float32 on CPU (bf16 matmuls are slow there), bfloat16 on CUDA."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def dtype_bytes(dtype_name: str) -> int:
    """Element size of the runtime dtype, for KV and weight byte counts."""
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype_name]


def kv_bytes_per_token(model_path: Path, dtype_name: str) -> int:
    """K and V bytes one token occupies across all layers."""
    cfg = json.loads((model_path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes(dtype_name)


def weight_bytes_read_per_step(model_path: Path, dtype_name: str) -> int:
    """Bytes of weights one decode step streams: every matrix once, minus the embedding lookup.

    With tied embeddings the LM head reads the (single stored) embedding matrix, so it counts.
    """
    from safetensors import safe_open

    cfg = json.loads((model_path / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings", False))
    numel = 0
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                n = math.prod(f.get_slice(name).get_shape())
                if name.endswith("embed_tokens.weight") and not tied:
                    continue  # only a few rows are gathered per step
                numel += n
    return numel * dtype_bytes(dtype_name)


def build_random_model(name: str, base: Path, *, fill: str = "normal") -> Path:
    """Write a checkpoint of `MODEL_CONFIGS[name]`'s shape (Llama unless it names another
    `architecture`) with random bf16 weights (cached; same config, same files).

    `fill="tiled"` (Llama only; the GPU check's 8B shape) streams the checkpoint to disk one
    tensor at a time, each a run of one 32 MiB pool of N(0, 0.02) values from its own offset
    (`write_tiled_safetensors`): gigabytes in seconds, where drawing every value takes
    minutes, and memory for one tensor at most. The values are as random as timing needs.

    Weights are drawn directly in bf16 from a seeded generator on CPU, so no CUDA context is
    created in the parent process (it would skew the children's GPU memory sizing). Llama's
    tensors are written under their state-dict names; another architecture's model is filled
    in place and saved by transformers, which writes the checkpoint names every loader reads
    (per-expert matrices for mixture-of-experts models, not transformers' stacked ones).
    Norm weights start as identities: 1, or 0 where the family's norms scale by (1 + w).
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    from workers.model_files import cache_root
    from workers.runner.models.registry import family_of

    spec = MODEL_CONFIGS[name]
    if fill not in ("normal", "tiled"):
        raise ValueError(f"fill must be normal or tiled, not {fill!r}")
    keyed = [spec, FOLDER_LAYOUT] if fill == "normal" else [spec, FOLDER_LAYOUT, fill]
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root() / "bench" / f"{name}-random-{digest}"
    if any(out.glob("*.safetensors")):
        return out
    settings = dict(spec)
    architecture = settings.pop("architecture", "LlamaForCausalLM")
    model_cls = getattr(transformers, architecture)
    base_cfg = json.loads((base / "config.json").read_text())
    config = model_cls.config_class(
        **settings,
        bos_token_id=base_cfg.get("bos_token_id"),
        eos_token_id=base_cfg.get("eos_token_id"),
        pad_token_id=base_cfg.get("pad_token_id"),
    )
    config.architectures = [architecture]
    config.dtype = "bfloat16"
    if fill == "tiled" and architecture != "LlamaForCausalLM":
        raise ValueError("fill='tiled' writes Llama checkpoints only")
    gen = torch.Generator().manual_seed(0)
    # a norm scales by its weight, or by (1 + weight) in a family whose norms are offset
    # (Gemma): either way an identity norm to start from
    norm_value = 1.0 - family_of(config).arch(config).norm_offset

    def fill_tensor(key: str, t: torch.Tensor) -> torch.Tensor:
        if key.endswith("norm.weight"):
            return t.fill_(norm_value)
        return t.normal_(0.0, 0.02, generator=gen)

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    if fill == "tiled":
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in model_cls(config).state_dict().items()
                      if not (k == "lm_head.weight" and config.tie_word_embeddings)}
        config.save_pretrained(tmp)
        write_tiled_safetensors(tmp / "model.safetensors", shapes, norm_value=norm_value)
    elif architecture == "LlamaForCausalLM":
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in model_cls(config).state_dict().items()}
        tensors: dict[str, torch.Tensor] = {}
        for key, shape in shapes.items():
            if key == "lm_head.weight" and config.tie_word_embeddings:
                continue
            tensors[key] = fill_tensor(key, torch.empty(shape, dtype=torch.bfloat16))
        config.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        with torch.device("meta"):
            model = model_cls(config).to(torch.bfloat16)
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for key, param in model.named_parameters():
                fill_tensor(key, param)
        if config.tie_word_embeddings:  # one matrix, as the real checkpoints keep it
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        model.save_pretrained(tmp)
        del model
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy2(f, tmp / f.name)
    if out.exists():  # another run finished first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out


def write_tiled_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], *,
                            norm_value: float = 1.0, seed: int = 0,
                            pool_elements: int = 1 << 24) -> None:
    """A bfloat16 safetensors file written as it is made: the header, then each tensor, a run
    of a seeded pool of N(0, 0.02) values starting at the tensor's own offset (norm weights:
    `norm_value`). Nothing larger than the pool is held in memory."""
    import struct

    import torch

    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty(2 * pool_elements, dtype=torch.bfloat16)
    pool[:pool_elements].normal_(0.0, 0.02, generator=gen)
    pool[pool_elements:] = pool[:pool_elements]  # a run may wrap: read it from the copy
    raw_pool = pool.view(torch.int16).numpy()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for i, (name, shape) in enumerate(shapes.items()):
            left = math.prod(shape)
            if name.endswith("norm.weight"):
                out.write(torch.full((left,), norm_value, dtype=torch.bfloat16)
                          .view(torch.int16).numpy().tobytes())
                continue
            start = (i * 2654435761) % pool_elements
            while left:
                run = min(left, pool_elements)
                out.write(memoryview(raw_pool[start : start + run]))
                left -= run
                start = (start + run) % pool_elements
