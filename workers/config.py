"""Engine arguments: one flat, typed set of knobs, as vLLM users expect them, declared once.

`EngineArgs` is the only place an engine setting, its default, its bound and its help live:
`LLM(**kwargs)` and `AsyncLLMEngine(**kwargs)` read it, the worker's command-line flags are
generated from it (`add_engine_arguments`), and the gateway's settings nest it for each
embedded model (`SWITCHBOARD_EMBEDDED__MAX_NUM_SEQS`, `gateway.settings.EmbeddedModel`).
Where serving wants another default than offline use (adapters on), `SERVING_DEFAULTS` says so,
once, for the worker and the gateway alike.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              arbitrary_types_allowed=True, protected_namespaces=())

    model: str | None = Field(None, description="HF folder or .gguf (None: bundled SmolLM2)")
    tokenizer: str | None = Field(None, description="tokenizer folder (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="weights and activations (default: float32 on CPU, bfloat16 on "
                          "CUDA)")
    device: str | None = Field(None, description="cpu or cuda (default: cuda where present)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    kv_cache_memory: int | None = Field(None, ge=1, description="KV pool bytes")
    kv_cache_fraction: float | None = Field(None, gt=0, le=1,
                                            description="KV pool as a share of free memory")
    max_num_seqs: int = Field(64, ge=1, description="sequences running at once")
    max_num_batched_tokens: int = Field(1024, ge=1, description="tokens one step computes")
    long_prefill_token_threshold: int = Field(
        512, ge=0, description="the most prompt tokens one request prefills per step (0: no "
                               "cap)")
    shared_step_s: float = Field(
        0.25, ge=0.0, le=60.0, description="while several tenants have work, the longest a "
                                           "step's prompt chunks may take (0: no limit)")
    interject_tokens: int | None = Field(
        None, ge=0, le=1 << 20, description="another tenant's request of at most this many "
        "prompt tokens runs between two layers of the step in flight (0: never; default 256 "
        "on CPU, 0 on CUDA)")
    background_decode_slots: int = Field(
        8, ge=0, le=1 << 16, description="while live requests run, the most background "
        "(priority 10: batch) requests decoding in one step (0: no limit)")
    scheduling_policy: Literal["fair", "fcfs"] = Field(
        "fair", description="fair: the least-served tenant's requests first, by weight (VTC);"
                            " fcfs: priority, then arrival")
    max_model_len: int | None = Field(None, ge=1, description="longest sequence (default: "
                                                              "the model's)")
    max_waiting: int = Field(4096, ge=1, description="queued requests before new ones fail "
                                                     "at once (overloaded)")
    enable_prefix_caching: bool = Field(True, description="reuse cached KV of shared prefixes")
    prefix_hot_window_s: float = Field(
        30.0, ge=0.0, description="a cached block let go of within this many seconds counts "
        "toward the KV working set reported for prefix-aware routing")
    enable_lora: bool = Field(False, description="serve LoRA adapters, batched per row")
    max_loras: int = Field(4, ge=1, description="adapters resident on the device at once")
    max_lora_rank: int = Field(16, ge=1, description="the largest adapter rank served")
    max_cpu_loras: int | None = Field(None, ge=1, description="loaded adapters kept in host "
                                                              "memory (default 4 x max_loras)")
    attention_backend: Literal["auto", "torch", "triton", "cpu"] = Field(
        "auto", description="decode attention (auto: Triton on CUDA, the C kernel on CPU)")
    prefill_attention: Literal["auto", "amx", "vec", "flash", "masked", "causal"] = Field(
        "auto", description="prompt chunks (auto: AMX for bfloat16 where the CPU has it, else "
                            "the AVX-512 kernel where it runs, else flash; causal on CUDA)")
    linear_backend: Literal["auto", "torch", "onednn", "onednn_packed", "amx", "avx512_bf16",
                            "onednn_upcast"] = Field(
        "auto", description="projection GEMMs (auto: oneDNN on CPU, weights blocked once, "
                            "with AMX or AVX-512 BF16 tiles for few-row bfloat16 matmuls "
                            "where the CPU has them)")
    elementwise: Literal["auto", "torch", "cpu"] = Field(
        "auto", description="residual add + RMSNorm, SiLU-and-multiply and RoPE (auto: the C "
                            "kernels for float32 on CPU)")
    kv_huge_pages: bool = Field(True, description="the CPU KV pool in 2 MB pages where Linux "
                                                  "offers them")
    keep_host_heap: bool = Field(
        True, description="on CPU, freed activations stay in the heap for the next step "
                          "instead of going back to the OS (glibc; workers/runner/host_heap.py)")
    cuda_graphs: bool = Field(
        True, description="decode-only steps replay CUDA graphs captured at startup, one per "
                          "batch-size bucket (CUDA with the Triton decode kernel only; "
                          "ignored on CPU)")
    cuda_graph_sizes: list[int] | None = Field(
        None, description="the decode batch sizes captured, as JSON, e.g. [1, 2, 4, 8] "
                          "(default: 1, 2, 4, then every 8 up to 256, every 16 after, and "
                          "max_num_seqs; larger batches run eagerly)")
    quantization: Literal["none", "int8"] = Field(
        "none", description="int8: projections, embedding and LM head as int8 with "
                            "per-channel scales")
    int8_compute: Literal["auto", "model", "bfloat16"] = Field(
        "auto", description="the dtype int8 weights multiply in (auto: bfloat16 on a CPU with "
                            "bfloat16 dot products, for a float32 model)")
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        "auto", description="KV cache: the model dtype, or int8 with a scale per token and "
                            "head")
    # A mapping (or a `SpeculativeConfig`); JSON in an environment variable or a flag.
    speculative: dict[str, Any] | Any = Field(
        None, description='speculative decoding as JSON, e.g. {"method": "ngram", '
                          '"num_tokens": 4} (docs/engine.md)')

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _graph_sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or min(value) < 1):
            raise ValueError("cuda_graph_sizes must be positive batch sizes")
        return value

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, value: Any) -> Any:
        """Checked at construction (a worker's flag, a gateway setting), not at first load."""
        from workers.engine.speculative import SpeculativeConfig

        SpeculativeConfig.parse(value)
        return value

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Reject unknown keywords by name instead of silently dropping them."""
        unknown = sorted(set(kwargs) - set(cls.model_fields))
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's own fields (a subclass's extra ones, such as a gateway's price, left
        out): what `AsyncLLMEngine(**...)` takes."""
        return {name: getattr(self, name) for name in EngineArgs.model_fields}


SERVING_DEFAULTS: dict[str, Any] = {"enable_lora": True}
"""Where a server (a worker, the gateway's embedded engine) differs from offline `LLM()`."""


def add_engine_arguments(parser: argparse.ArgumentParser, *,
                         defaults: dict[str, Any] | None = None) -> None:
    """One `--flag` per engine field: its type, choices, default and help from `EngineArgs`."""
    overrides = defaults or {}
    for name, field in EngineArgs.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = overrides.get(name, field.default)
        kind, choices = _flag_type(field.annotation)
        help_text = field.description or ""
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        else:
            parser.add_argument(flag, type=kind, choices=choices, default=default,
                                help=help_text, dest=name)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    """The flags `add_engine_arguments` declared, back as `EngineArgs` (checked there)."""
    return EngineArgs(**{name: getattr(namespace, name) for name in EngineArgs.model_fields})


def _flag_type(annotation: Any) -> tuple[Any, tuple[str, ...] | None]:
    """(argparse type, choices) of a field's annotation; JSON for what is not a scalar."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] \
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) \
        is typing.Union else [annotation]
    base = args[0] if args else annotation
    if typing.get_origin(base) is Literal:
        return str, typing.get_args(base)
    if base in (int, float, str, bool):
        return base, None
    return _json_flag, None


def _json_flag(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc

