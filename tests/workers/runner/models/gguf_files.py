"""Writing a tiny random checkpoint of a family as a GGUF file, the way llama.cpp's
`convert_hf_to_gguf.py` lays one out: llama.cpp's architecture name and tensor names (from the
`gguf` package's own map), its metadata keys, F32 tensors, and a byte-level BPE vocabulary (the
bundled SmolLM2 tokenizer's) under `tokenizer.ggml.*`.

llama.cpp's conventions that a reader has to undo are applied here as the converter applies them:

- arch `llama` (which llama.cpp also writes for Mistral and Mixtral checkpoints): the rows of
  q_proj and k_proj are permuted per head, from HF's rotate-half pairing to GGML's interleaved one;
- Gemma 2 / 3: every `*norm.weight` is stored as 1 + w (HF's Gemma norms multiply by 1 + w);
- MoE: the experts of a layer are one 3-D tensor each for gate, up and down (`ffn_*_exps`);
- a tied LM head is left out (no `output.weight`);
- Llama 3's RoPE scaling is a `rope_freqs` tensor (each frequency's divisor), Phi-3's
  LongRoPE two factor tensors, not metadata.

The vocabulary is SmolLM2's first `vocab` tokens and the merges among them: reading a GGUF's
49,152 tokens and merges takes transformers seconds per load, 1,024 of them milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

# our family -> llama.cpp's architecture for it (convert_hf_to_gguf registers MistralForCausalLM
# and MixtralForCausalLM under its Llama model class, arch `llama`)
GGUF_ARCH: dict[str, str] = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
    "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3": "gemma3",
    "phi3": "phi3",
}
GEMMA_ARCHS = ("gemma2", "gemma3")

# llama.cpp's token types (gguf.TokenType)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def permute_for_ggml(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q/k rows (per head: the first half of the rotary pairs, then the second) in GGML's
    order (per head: the pairs interleaved), as llama.cpp's Llama converter writes them."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def gguf_tensors(hf_model: Any, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names for `arch`, in llama.cpp's conventions."""
    import gguf

    config = hf_model.config
    layers = config.num_hidden_layers
    names = gguf.get_tensor_name_map(_model_arch(arch), layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in hf_model.state_dict().items():
        tensor = tensor.detach().float()
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        if base.endswith(".mlp.experts") and suffix in ("gate_up_proj", "down_proj"):
            # HF keeps gate and up of every expert as one [experts, 2 x inter, hidden] tensor
            block = base.split(".")[2]
            if suffix == "down_proj":
                out[f"blk.{block}.ffn_down_exps.weight"] = _array(tensor)
            else:
                gate, up = tensor.chunk(2, dim=1)
                out[f"blk.{block}.ffn_gate_exps.weight"] = _array(gate)
                out[f"blk.{block}.ffn_up_exps.weight"] = _array(up)
            continue
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise KeyError(f"{arch}: no llama.cpp name for {hf_name}")
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            tensor = permute_for_ggml(tensor, heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            tensor = permute_for_ggml(tensor, kv_heads)
        if arch in GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            tensor = tensor + 1.0
        out[f"{gguf_name}.{suffix}"] = _array(tensor)
    return out


def write_gguf(path: Path, hf_model: Any, tokenizer: Any, family: str) -> Path:
    """Write `hf_model` (a `build_family` model of `family`, its vocabulary SmolLM2's first
    `vocab_size` tokens) as the GGUF llama.cpp would."""
    import gguf

    arch = GGUF_ARCH[family]
    config = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {family}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch in ("llama", "phi3"):
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(
            int(head_dim * _rope(config).get("partial_rotary_factor", 1.0)))
    writer.add_key_length(head_dim)  # llama.cpp writes them where config.json has head_dim
    writer.add_value_length(head_dim)
    if getattr(config, "sliding_window", None) or arch == "phi3":  # phi3: 0 for none
        writer.add_sliding_window(config.sliding_window or 0)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping or 0.0)
        writer.add_final_logit_softcapping(config.final_logit_softcapping or 0.0)
    rope = _rope(config)
    if rope.get("rope_type") == "linear":  # Gemma 3: its global layers' scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    add_vocabulary(writer, tokenizer, config.vocab_size)
    tensors = gguf_tensors(hf_model, arch)
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_divisors(config)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                             or config.max_position_embeddings)
    if rope.get("rope_type") == "longrope":  # the factors as tensors, as llama.cpp keeps them
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    for tensor_name, array in tensors.items():
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_divisors(config: Any) -> np.ndarray:
    """What llama.cpp stores for Llama 3's RoPE scaling: per frequency, the plain inverse
    frequency over the scaled one (1 for the fast ones, `factor` for the slowest)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = _rope(config)["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return _array(plain / scaled.double())


def add_vocabulary(writer: Any, tokenizer: Any, size: int) -> None:
    """SmolLM2's first `size` tokens as llama.cpp's `_set_vocab_gpt2` writes a byte-level BPE
    vocabulary: every token by id, its type (added special tokens CONTROL, other added ones
    USER_DEFINED), the merges among those tokens, the special ids."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    added = {token["id"]: token["special"] for token in spec["added_tokens"]}
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    kept = set(tokens)
    merges = [" ".join(pair) for pair in (
        m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"])
        if pair[0] in kept and pair[1] in kept and pair[0] + pair[1] in kept]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([
        (CONTROL if added[i] else USER_DEFINED) if i in added else NORMAL
        for i in range(len(tokens))])
    writer.add_token_merges(merges)
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                          ("unk", tokenizer.unk_token_id), ("pad", tokenizer.pad_token_id)):
        if token_id is not None and token_id < size:
            getattr(writer, f"add_{key}_token_id")(token_id)


def _model_arch(arch: str) -> Any:
    import gguf

    return next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)


def _rope(config: Any) -> dict[str, Any]:
    """The RoPE settings llama.cpp's metadata describes: Gemma 3's global layers' ones."""
    rope = getattr(config, "rope_parameters", None) or {}
    return dict(rope.get("full_attention", rope))


def _rope_theta(config: Any) -> float:
    return float(_rope(config).get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().numpy().astype(np.float32)
