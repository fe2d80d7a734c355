"""The GPU check's benchmark parts (bench/gpu_check.py, issue 41 §4): decode memory-bandwidth
utilisation of random bfloat16 models of real shapes, and the standard workload against HF's
continuous batching (`generate_batch`'s manager) through bench/engine_throughput.py.

Decode bandwidth: for each batch size, the same engine generates `short` and then `long`
tokens for fresh prompts of `prompt_len` tokens (prefix caching cannot help); the difference
of the two wall times over `long - short` is one decode step, prefill and start-up cancelling.
A step reads every weight once (the embedding's lookup rows aside; a tied embedding is the LM
head and counts) and each row's KV at its mean context, `prompt_len + (short + long) / 2`:

    utilisation = (weight bytes + batch x context x KV bytes per token) / step time
                  / copy bandwidth

where the copy bandwidth is a device-to-device copy measured in the same process, counting
bytes read and written (`bench/common/machine.measure_copy_bandwidth`). On a CPU, `--tiny`
runs the same code on a two-layer model in seconds: what the tests check.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common.model_folders import (
    build_random_model,
    kv_bytes_per_token,
    model_dtype_name,
    weight_bytes_read_per_step,
)
from bench.common.throughput_stats import sync
from bench.common.workload import decode_prompts

# The check's models (MODEL_CONFIGS names) and, for --tiny, the one small shape all stand for.
DECODE_MODELS = {"smollm2": "smollm2-135m", "llama-1b": "llama-3.2-1b",
                 "llama-8b": "llama-3.1-8b"}
STANDARD_MODEL = "smollm2-135m"
TINY_MODEL = "gpu-check-tiny"


def bandwidth_row(batch: int, step_s: float, weight_bytes: int, kv_bytes_per_token: int,
                  context: float, copy_bytes_per_s: float | None) -> dict[str, Any]:
    """One batch size's decode figures from its measured step time."""
    step_bytes = weight_bytes + batch * context * kv_bytes_per_token
    achieved = step_bytes / step_s if step_s > 0 else None
    return {
        "batch": batch,
        "step_ms": step_s * 1e3,
        "context": context,
        "bytes_per_step": step_bytes,
        "achieved_gb_s": achieved / 1e9 if achieved else None,
        "utilisation": achieved / copy_bytes_per_s if achieved and copy_bytes_per_s else None,
    }


def measure_decode(llm: Any, sp_cls: Any, tokenizer: Any, *, batches: list[int],
                   prompt_len: int, short: int, long: int, device: str, weight_bytes: int,
                   kv_bytes_per_token: int, copy_bytes_per_s: float | None, seed: int = 0,
                   reps: int = 1, warm: bool = True, deadline: float | None = None,
                   clock: Callable[[], float] = time.perf_counter,
                   on_row: Callable[[list[dict[str, Any]]], None] | None = None,
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, skipped): one `bandwidth_row` per batch size. A batch size that would not end
    before `deadline` (a `clock()` time; it takes at least as long as the one before) is
    skipped with the reason. `warm` runs each batch size once first (kernel compiles,
    allocator growth, graph captures); `reps` takes the best of that many timed runs per
    length. `clock` times the runs and reads the deadline; `on_row` is told the rows so far
    after each one (a partial result survives a kill)."""
    if long <= short:
        raise ValueError("long must be greater than short")
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    context = prompt_len + (short + long) / 2
    last = 0.0
    for b in batches:
        begun = clock()
        if deadline is not None and begun + last >= deadline:
            skipped.append({"batch": b, "reason": "out of time"})
            continue
        if warm:
            llm.generate(decode_prompts(tokenizer, b, prompt_len, seed=seed + 7919 + b),
                         sp_cls(temperature=0.0, max_tokens=short, ignore_eos=True,
                                detokenize=False))
        walls = []
        for k, n_out in enumerate((short, long)):
            params = sp_cls(temperature=0.0, max_tokens=n_out, ignore_eos=True,
                            detokenize=False)
            best = math.inf
            for rep in range(reps):
                prompts = decode_prompts(tokenizer, b, prompt_len, seed=seed + 1000 * b
                                         + 10 * k + rep)
                sync(device)
                start = clock()
                llm.generate(prompts, params)
                sync(device)
                best = min(best, clock() - start)
            walls.append(best)
        step = (walls[1] - walls[0]) / (long - short)
        row = bandwidth_row(b, step, weight_bytes, kv_bytes_per_token, context,
                            copy_bytes_per_s)
        row.update(wall_short_s=walls[0], wall_long_s=walls[1])
        rows.append(row)
        last = clock() - begun
        if on_row is not None:
            on_row(rows)
    return rows, skipped


def decode_part(shape: str, base: Path, *, device: str, tiny: bool, batches: list[int],
                prompt_len: int, short: int, long: int, deadline: float | None = None,
                on_partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Build (or reuse) the random model of `shape` (a DECODE_MODELS key), load the engine on
    `device` in the device's dtype, measure the copy bandwidth there, then the decode rows
    (`on_partial` gets the result so far after each)."""
    from transformers import AutoTokenizer

    from bench.common.machine import measure_copy_bandwidth
    from workers import LLM, SamplingParams

    name = TINY_MODEL if tiny else DECODE_MODELS[shape]
    t0 = time.perf_counter()
    path = build_random_model(name, base, fill="tiled")
    build_s = time.perf_counter() - t0
    dtype = model_dtype_name(device)
    weights = weight_bytes_read_per_step(path, dtype)
    kv_tok = kv_bytes_per_token(path, dtype)
    most = max(batches)
    block = 16
    kv_bytes = math.ceil(most * (prompt_len + long + 2 * block) * kv_tok * 1.25)
    t0 = time.perf_counter()
    llm = LLM(str(path), device=device, dtype=dtype, max_num_seqs=most,
              max_num_batched_tokens=8192 if device.startswith("cuda") else 2048,
              kv_cache_memory=kv_bytes, block_size=block)
    load_s = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(path)
    copy_bw = measure_copy_bandwidth(device)
    result = {"shape": shape, "model": name, "dtype": dtype, "build_s": build_s,
              "load_s": load_s, "weight_bytes": weights, "kv_bytes_per_token": kv_tok,
              "kv_cache_bytes": kv_bytes, "copy_gb_s": copy_bw / 1e9,
              "prompt_len": prompt_len, "outputs": [short, long], "detokenize": False,
              "rows": [], "skipped_batches": []}

    def partial(rows: list[dict[str, Any]]) -> None:
        if on_partial is not None:
            on_partial({**result, "rows": rows, "partial": True})

    rows, skipped = measure_decode(
        llm, SamplingParams, tokenizer, batches=batches, prompt_len=prompt_len, short=short,
        long=long, device=device, weight_bytes=weights, kv_bytes_per_token=kv_tok,
        copy_bytes_per_s=copy_bw, deadline=deadline, on_row=partial)
    return {**result, "rows": rows, "skipped_batches": skipped}


def standard_argv(mode: str, *, device: str, tiny: bool, results: Path, timeout: float
                  ) -> list[str]:
    """bench/engine_throughput.py's arguments for the standard workload on the SmolLM2 shape
    with random weights: offline, the engine against HF's continuous batching; online, the
    engine alone (TTFT and TPOT under Poisson arrivals). --tiny: four short requests on the
    tiny shape."""
    argv = ["--device", device, "--model-config", TINY_MODEL if tiny else STANDARD_MODEL,
            "--results", str(results), "--timeout", f"{max(timeout, 1.0):.0f}",
            "--no-bandwidth"]
    if mode == "offline":
        argv += ["--systems", "engine,hf_batch", "--mode", "offline"]
    else:
        argv += ["--systems", "engine", "--mode", "online"]
    if tiny:
        argv += ["--num-requests", "4", "--min-prompt", "8", "--max-prompt", "32",
                 "--min-output", "4", "--max-output", "8", "--threads", "1", "--rate", "20"]
    return argv


def standard_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The figures the check keeps from engine_throughput's report."""
    keep = ("output_tok_s", "wall_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
            "engine_ratio", "greedy_agreement", "lengths_ok", "error", "device_name",
            "peak_gpu_mib", "load_s")
    runs = [{"system": r.get("system"), "mode": r.get("mode"),
             **{k: r[k] for k in keep if k in r}} for r in report.get("results", [])]
    out: dict[str, Any] = {"model": report.get("model"), "workload": report.get("workload"),
                           "runs": runs}
    engine = next((r for r in runs if r["system"] == "engine" and "error" not in r), None)
    hf = next((r for r in runs if r["system"] == "hf_batch" and "error" not in r), None)
    if engine and hf and hf.get("output_tok_s"):
        out["engine_over_hf_batch"] = engine["output_tok_s"] / hf["output_tok_s"]
    return out
