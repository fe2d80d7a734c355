"""Our compact models: one decoder of shared layers (`layers`), one small module per family
stating how it differs from Llama (`llama`, `mistral`, `qwen2`, `qwen3`, `gemma2`, `gemma3`,
`phi3`, and the mixture-of-experts `qwen3_moe`, `mixtral` and `gpt_oss` over the shared
`experts` block), chosen by `registry` from config.json's `architectures` (then `model_type`);
weights are read by name (`weights`). Importing this package imports no torch (the registry's check
runs anywhere); `layers` and `weights` do."""

from workers.runner.models.registry import (
    FAMILIES,
    Family,
    UnsupportedModelError,
    build_model,
    check_model_folder,
    family_of,
    served_architectures,
)

__all__ = ["FAMILIES", "Family", "UnsupportedModelError", "build_model", "check_model_folder",
           "family_of", "served_architectures"]
