"""HF transformers as the yardstick: greedy generate() one prompt at a time, no padding."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: bool = True) -> list[int]:
    ids = torch.tensor([prompt_ids])
    kwargs = {} if eos else {"eos_token_id": None, "min_new_tokens": max_new_tokens}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0, **kwargs,
    )
    return out[0, len(prompt_ids):].tolist()
