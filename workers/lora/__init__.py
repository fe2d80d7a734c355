"""Multi-LoRA: peft-format adapters, validated and loaded for batched per-row application."""

from workers.lora.adapter import SUPPORTED_MODULES, AdapterError, LoRAAdapter, load_adapter

__all__ = ["SUPPORTED_MODULES", "AdapterError", "LoRAAdapter", "load_adapter"]
