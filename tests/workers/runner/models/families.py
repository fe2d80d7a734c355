"""Tiny random checkpoints of every served family, built with transformers from a config in
code and saved as standard HF folders (safetensors, config.json, the bundled tokenizer), and
the yardstick: HF's own forward over each finished sequence."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

# Small enough to run in milliseconds; weights drawn wide (initializer_range) so next-token
# distributions are peaked and greedy comparisons test the engine, not float noise.
COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
    attn_implementation="eager",
)

# family -> (config class name, its settings over COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0})),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, attention_bias=False)),  # heads x dim != hidden
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24,
                                    final_logit_softcapping=3.0, attn_logit_softcapping=None,
                                    sliding_window=4096)),
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=4096,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False)),
    # 8 experts, top 2; raw top-k weights (not renormalised) and a dense MLP on layer 1
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                                      sliding_window=None)),
    # 8 experts, top 2, a SwiGLU limit low enough that both clamps bind; YaRN from 64 positions
    "gpt_oss": ("GptOssConfig", dict(
        head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        swiglu_limit=1.5, sliding_window=4096, rope_parameters=dict(
            rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64, rope_theta=150000.0))),
}

# families whose windows (and Gemma 2's attention soft-capping) bind inside the test's lengths
WINDOWED: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=16),
    "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "gemma2": dict(sliding_window=16, attn_logit_softcapping=5.0),
    "gemma3": dict(sliding_window=16),
    "mixtral": dict(sliding_window=16),
    "gpt_oss": dict(sliding_window=8),  # with attention sinks
}


def build_family(folder: Path, tokenizer, family: str, **overrides: Any):
    """Save a random `family` checkpoint in `folder`; returns HF's float32 model of it."""
    import transformers

    class_name, settings = FAMILIES[family]
    config = getattr(transformers, class_name)(**{
        **COMMON, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
        **settings, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # HF starts norms at 1 (or 0 for 1 + w) and biases at 0: vary them
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith((".bias", "_bias")):
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith(".sinks"):  # gpt-oss: sinks as large as the scores, so they count
                param.normal_(0.0, 2.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def random_prompts(count: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@torch.inference_mode()
def assert_greedy_like_hf(hf_model, prompts: list[list[int]], outputs: list[list[int]],
                          tie: float = 1e-3) -> None:
    """Every generated token is HF's argmax at its step, given the tokens before it (a
    float32 near-tie within `tie` of the best logit allowed): one HF forward per sequence."""
    for prompt, tokens in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + tokens])
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
        best = logits.max(dim=-1).values
        chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
        off = (chosen < best - tie).nonzero()
        assert off.numel() == 0, (
            f"step {off[0].item()} of a {len(prompt)}-token prompt: token {tokens[off[0]]} "
            f"scores {chosen[off[0]].item():.5f}, HF's argmax "
            f"{logits[off[0]].argmax().item()} {best[off[0]].item():.5f}")
