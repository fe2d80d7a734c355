"""Multi-LoRA: peft-format adapters, validated and loaded for batched per-row application.

The adapter module imports torch: it is loaded on first use of a name from it, so the
torch-free parts (the manager's errors and bookkeeping) cost a gateway nothing.
"""

from typing import Any

__all__ = ["SUPPORTED_MODULES", "AdapterError", "LoRAAdapter", "load_adapter"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from workers.lora import adapter

        return getattr(adapter, name)
    raise AttributeError(f"module 'workers.lora' has no attribute {name!r}")
