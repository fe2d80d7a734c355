"""Decode attention over the paged pool: the torch backend vs the in-place kernels.

For each model shape, batch size and context length, one decode step's attention (one query
token per sequence, contexts scattered over a shuffled pool) is timed for:

- `torch`: the CPU/portable path, one `index_select` of whole (block, head) pieces + SDPA per
  length group;
- `triton`: `workers/runner/triton_decode.py`, which reads K/V in place (CUDA only; on CPU
  Triton only interprets, which says nothing about speed);
- `cpu`: `workers/runner/cpu_decode.py`, the C kernel that reads K/V in place (CPU only).

Reported: microseconds per call (median), the K/V bytes each call must read, the bandwidth
that makes, and its share of a measured copy (device-to-device on CUDA, memory on CPU). Each
system's output is checked against the per-head float32 reference on one small case per shape
(`max err`).

Usage: .venv/bin/python bench/attention_kernels.py [--device cuda] [--batches 1,8,32,64]
       [--contexts 256,1024,4096] [--shapes smollm2,llama-1b]
Prints a table last and writes bench/results/attention_kernels-<device>.json (a run narrower
than the defaults writes the git-ignored ...-smoke.json instead).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common.machine import cpu_model, measure_copy_bandwidth  # noqa: E402
from workers.runner.attention import (  # noqa: E402
    build_metadata,
    paged_attention,
    reference_attention,
)

RESULTS = Path(__file__).resolve().parent / "results"
# (query heads, KV heads, head dim): SmolLM2-135M and a Llama-3.2-1B shape
SHAPES = {"smollm2": (9, 3, 64), "llama-1b": (32, 8, 64)}
BLOCK = 16


def make_case(
    shape: tuple[int, int, int], batch: int, context: int, dtype: torch.dtype,
    device: torch.device, seed: int = 0,
) -> dict[str, Any]:
    """A pool with every sequence's blocks scattered (shuffled) and one query token per row."""
    heads, kv_heads, dim = shape
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, kv_heads, BLOCK, dim, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, kv_heads, BLOCK, dim, generator=g).to(device, dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    seqs = [(context - 1, 1, [free.pop() for _ in range(blocks_per_seq)]) for _ in range(batch)]
    q = torch.randn(batch, heads, dim, generator=g).to(device, dtype)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "seqs": seqs,
            "group": heads // kv_heads,
            "kv_bytes": 2 * batch * context * kv_heads * dim * k_cache.element_size()}


def attend(case: dict[str, Any], backend: str, device: torch.device) -> Any:
    """A closure running one decode step's attention; its metadata is built once, untimed."""
    q = case["q"]
    meta = build_metadata(case["seqs"], BLOCK, case["k_cache"].shape[1], case["group"], device,
                          q.dtype, decode_kernel=None if backend == "torch" else backend)
    scale = q.shape[-1] ** -0.5

    def call() -> torch.Tensor:
        return paged_attention(q, q, q, case["k_cache"], case["v_cache"], meta, scale, BLOCK)

    return call


def time_call(call: Any, device: torch.device, iters: int) -> float:
    """Median seconds per call after warm-up (compiles the kernel on first use)."""
    for _ in range(3):
        call()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def max_error(shape: tuple[int, int, int], backend: str, dtype: torch.dtype,
              device: torch.device) -> float:
    case = make_case(shape, 8, 300, dtype, device, seed=1)
    call = attend(case, backend, device)
    out = call().float().cpu()
    rows = [(i, 1, start, table) for i, (start, _, table) in enumerate(case["seqs"])]
    ref = reference_attention(case["q"].float().cpu(), case["k_cache"].float().cpu(),
                              case["v_cache"].float().cpu(), rows, BLOCK, shape[2] ** -0.5)
    return float((out - ref).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="smollm2,llama-1b")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = ["torch", "triton"] if device.type == "cuda" else ["torch", "cpu"]
    copy_bw = measure_copy_bandwidth(args.device)
    rows: list[dict[str, Any]] = []
    errors: dict[str, dict[str, float]] = {}
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        errors[shape_name] = {b: max_error(shape, b, dtype, device) for b in backends}
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                case = make_case(shape, batch, context, dtype, device)
                for backend in backends:
                    call = attend(case, backend, device)
                    seconds = time_call(call, device, args.iters)
                    gb_s = case["kv_bytes"] / seconds / 1e9
                    rows.append({
                        "shape": shape_name, "batch": batch, "context": context,
                        "backend": backend, "us": seconds * 1e6, "kv_mib": case["kv_bytes"] / 2**20,
                        "gb_s": gb_s, "of_copy": gb_s * 1e9 / copy_bw if copy_bw else None,
                    })
                del case
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else cpu_model(),
        "dtype": str(dtype), "torch": torch.__version__, "python": platform.python_version(),
        "block_size": BLOCK, "copy_gb_s": copy_bw / 1e9 if copy_bw else None,
        "max_error_vs_reference": errors, "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    # only the full default grid is the recorded result; a narrower run is a git-ignored smoke
    full = all(getattr(args, k) == parser.get_default(k)
               for k in ("shapes", "batches", "contexts", "iters"))
    out = RESULTS / f"attention_kernels-{device.type}{'' if full else '-smoke'}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwrote {out.relative_to(ROOT)}")
    return 0


def print_table(result: dict[str, Any]) -> None:
    print(f"attention_kernels  {result['date']}  {result['device']}  {result['dtype']}  "
          f"block {result['block_size']}  copy {fmt(result['copy_gb_s'])} GB/s")
    for shape, errs in result["max_error_vs_reference"].items():
        print(f"  max err vs float32 reference ({shape}, 8 x 300 tokens): "
              + ", ".join(f"{b} {e:.2e}" for b, e in errs.items()))
    head = (f"{'shape':>9} {'batch':>5} {'context':>7} {'backend':>7} {'us/call':>9} "
            f"{'KV MiB':>8} {'GB/s':>8} {'of copy':>7} {'vs torch':>8}")
    print(head)
    print("-" * len(head))
    torch_us: dict[tuple[str, int, int], float] = {}
    for r in result["rows"]:
        key = (r["shape"], r["batch"], r["context"])
        if r["backend"] == "torch":
            torch_us[key] = r["us"]
        speedup = torch_us[key] / r["us"] if key in torch_us else None
        share = f"{r['of_copy'] * 100:.0f}%" if r["of_copy"] is not None else "-"
        print(f"{r['shape']:>9} {r['batch']:>5} {r['context']:>7} {r['backend']:>7} "
              f"{r['us']:>9.1f} {r['kv_mib']:>8.1f} {r['gb_s']:>8.1f} {share:>7} "
              f"{fmt(speedup, 2) + 'x':>8}")


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    raise SystemExit(main())
