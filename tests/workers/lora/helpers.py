"""Make real peft adapters (random, non-zero B) on a base checkpoint for engine tests."""

from __future__ import annotations

from pathlib import Path

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base: Path, out: Path, *, seed: int = 0, **lora: object) -> Path:
    """Save a LoRA made by peft itself; `lora` overrides LoraConfig fields (r=8, alpha 16)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(init_lora_weights=False, **{
        "r": 8, "lora_alpha": 16, "target_modules": ALL_MODULES, **lora})
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path):
    """The reference: peft's own PeftModel on a fresh copy of the base."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter).eval()
