"""Engine arguments: one flat, typed set of knobs, as vLLM users expect them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    device: str | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    # The most prompt tokens one request may prefill per step (0: no cap); see
    # SchedulerConfig and docs/engine.md.
    long_prefill_token_threshold: int = 512
    # While two or more tenants have had work in the last 10 s, the prompt chunks of one step
    # may take at most this long at the measured speed (0: no limit); SchedulerConfig.
    shared_step_s: float = 0.25
    # A short request (whole prompt at most this many tokens) of a tenant not ahead by more
    # than that of the other tenants in the step in flight runs in a step of its own between
    # two of that step's layers instead of waiting for it to end (0: never; None: 256 on
    # CPU, 0 on CUDA); Scheduler.schedule_interjection.
    interject_tokens: int | None = None
    # fair: the least-served tenant's requests are admitted first, by weight (VTC,
    # workers/engine/fair_share.py); fcfs: priority, then arrival, whoever sent them
    scheduling_policy: str = "fair"
    max_model_len: int | None = None
    max_waiting: int = 4096
    enable_prefix_caching: bool = True
    # A cached block a sequence let go of within this many seconds counts toward the KV
    # working set /stats reports (`kv_hot_tokens`): gateways place new prompts where they
    # evict no one's next turn (docs/gateway.md). A few times the users' think time.
    prefix_hot_window_s: float = 30.0
    enable_lora: bool = False
    max_loras: int = 4  # adapters resident on the device at once
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # loaded copies kept in host memory; None = 4 * max_loras
    attention_backend: str = "auto"  # auto | torch | triton | cpu (in-place decode kernels)
    prefill_attention: str = "auto"  # auto | amx | vec | flash | masked (prompt chunks)
    # auto | torch | onednn | onednn_packed (weights blocked once at load) | amx (bfloat16:
    # also an AMX tile-layout copy for matmuls of few rows) | avx512_bf16 (the same copy read
    # by AVX-512 BF16 dot products) | onednn_upcast (bfloat16 as float32 matmuls, for CPUs
    # without bfloat16 dot products); projections' GEMM
    linear_backend: str = "auto"
    # auto | torch | cpu (C kernels: residual add + RMSNorm, SiLU-and-multiply, RoPE)
    elementwise: str = "auto"
    kv_huge_pages: bool = True  # the CPU KV pool in 2 MB pages where Linux offers them
    # none | int8: projections, embedding and LM head as int8 with per-channel scales
    # (workers/runner/quantization.py)
    quantization: str = "none"
    # auto | model | bfloat16: the dtype int8 weights are widened to for matmuls; auto is
    # bfloat16 on a CPU with bfloat16 dot products (AVX512_BF16, AMX) for a float32 model
    int8_compute: str = "auto"
    # auto (the model dtype) | int8: K/V rows as int8 with a float32 scale per token and head
    kv_cache_dtype: str = "auto"
    # Speculative decoding: None (off) or {"method": "ngram", "num_tokens": k, ...}
    # (workers/engine/speculative.py SpeculativeConfig)
    speculative: dict | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Reject unknown keywords by name instead of silently dropping them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)
