"""bench/engine_throughput.py's report: the comparisons between its systems' runs (speed
against the engine's, greedy agreement), the JSON report, and the table printed last."""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path
from typing import Any

from bench.common.machine import machine_info
from bench.common.throughput_stats import HEAD_TOKENS, percentile
from bench.common.workload import Workload


def compare(results: list[dict[str, Any]], wl: Workload) -> None:
    """Each run's prompt tok/s, the engine's speed over its own (same mode), and the greedy
    agreements (`greedy_agreement`), written into the runs' results."""
    prompt_total = sum(len(r.prompt_token_ids) for r in wl.requests)
    for r in results:
        if r.get("wall_s"):
            r["prompt_tok_s"] = prompt_total / r["wall_s"]
        eng = next((e for e in results if e["system"] == "engine" and e["mode"] == r["mode"]
                    and "error" not in e), None)
        if eng and "error" not in r and r.get("output_tok_s"):
            r["engine_ratio"] = eng["output_tok_s"] / r["output_tok_s"]
    greedy_agreement(results)


def build_report(args: argparse.Namespace, wl: Workload, results: list[dict[str, Any]], *,
                 standard: bool, threads: int) -> dict[str, Any]:
    """The JSON report: settings, machine, workload and every run's results (each request's
    output ids only with --keep-outputs). `threads` is the torch thread count asked of every
    child; what each child had before and after its run is in `thread_counts`."""
    counts = {f"{r['system']}/{r['mode']}": (r.get("threads_before"), r.get("threads_after"))
              for r in results if "error" not in r}
    machine = machine_info(args.device)
    gpu = next((r["device_name"] for r in results if r.get("device_name")), None)
    if gpu:
        machine["gpu"] = gpu
    return {
        "benchmark": "engine_throughput",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "standard_workload": standard,
        "workload_name": args.workload,
        "machine": machine,
        "model": args.model_config,
        "model_path": args.model_path,
        "dtype": args.dtype,
        "threads": threads,
        "thread_counts": counts,
        "threads_identical": len({v for pair in counts.values() for v in pair}) <= 1,
        "kv_cache_bytes": args.kv_cache_bytes,
        "max_num_seqs": args.max_num_seqs,
        "max_batched_tokens": args.max_batched_tokens,
        "workload": wl.summary(),
        "prompt_lengths": [len(r.prompt_token_ids) for r in wl.requests],
        "results": [{k: v for k, v in r.items()
                     if args.keep_outputs or k not in ("heads", "outputs")}
                    for r in results],
    }


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
