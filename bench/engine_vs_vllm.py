"""Issue 23's check in one run: the engine against vLLM's CPU build on all three workloads.

    .venv/bin/python bench/engine_vs_vllm.py                    # float32, offline
    .venv/bin/python bench/engine_vs_vllm.py --dtype bfloat16 --tag zen4

Runs `bench/engine_throughput.py --systems engine,vllm_cpu` on the standard, prefill-heavier
and long workloads back to back, so every ratio comes from one sitting of the same machine
(this VM's speed drifts 10-30% over an hour). Each workload's full report is written beside the
summary; the summary holds the CPU's model, family, model number and SIMD flags, each ratio
and whether it met the target.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from bench.common.workload import WORKLOADS  # noqa: E402
from workers.runner.cbuild import cpuinfo_line  # noqa: E402

TARGET = 1.2  # issue 23: engine output tok/s over vLLM-CPU's, offline, every workload


def cpu_identity() -> dict[str, Any]:
    """The CPU as lscpu names it: model name, family and model number, the SIMD flags."""
    def field(key: str) -> str | None:
        line = cpuinfo_line(key)
        return line.split(":", 1)[1].strip() if line else None

    return {"model_name": cpu_model(), "family": field("cpu family"), "model": field("model\t"),
            "simd_flags": simd_flags()}


def workload_argv(args: argparse.Namespace, workload: str, out: Path) -> list[str]:
    """One engine_throughput run: both systems, offline, this workload, its own JSON."""
    argv = [sys.executable, str(ROOT / "bench" / "engine_throughput.py"), "--workload",
            workload, "--systems", "engine,vllm_cpu", "--mode", "offline", "--dtype", args.dtype,
            "--results", str(out)]
    for item in args.engine_arg or []:
        argv += ["--engine-arg", item]
    return argv


def ratio_row(workload: str, report: dict[str, Any]) -> dict[str, Any]:
    """Output tok/s of both systems, their ratio and prompt tok/s, from one workload's report."""
    by_system = {r["system"]: r for r in report["results"] if "error" not in r}
    eng, vllm = by_system.get("engine"), by_system.get("vllm_cpu")
    row: dict[str, Any] = {"workload": workload}
    if eng is None or vllm is None:
        row["error"] = "; ".join(f"{r['system']}: {r['error']}" for r in report["results"]
                                 if "error" in r) or "a system is missing"
        return row
    row.update(engine_tok_s=eng["output_tok_s"], vllm_tok_s=vllm["output_tok_s"],
               engine_prompt_tok_s=eng.get("prompt_tok_s"),
               vllm_prompt_tok_s=vllm.get("prompt_tok_s"),
               ratio=eng["output_tok_s"] / vllm["output_tok_s"])
    row["met"] = row["ratio"] >= TARGET
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated (default: all three)")
    p.add_argument("--tag", default="", help="added to the result file names (e.g. the CPU)")
    p.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                   help="passed to engine_throughput.py; repeatable")
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}")

    stem = "engine_vs_vllm-" + "-".join(x for x in (args.tag, args.dtype) if x)
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for workload in workloads:
        out = results_dir / f"{stem}-{workload}.json"
        print(f"== {workload}", flush=True)
        done = subprocess.run(workload_argv(args, workload, out), check=False)
        if not out.exists():
            rows.append({"workload": workload, "error": f"exit {done.returncode}, no report"})
            continue
        rows.append(ratio_row(workload, json.loads(out.read_text())))

    summary = {"benchmark": "engine_vs_vllm",
               "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "cpu": cpu_identity(), "dtype": args.dtype, "target": TARGET, "rows": rows,
               "all_met": all(r.get("met") for r in rows)}
    path = results_dir / f"{stem}.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    cpu = summary["cpu"]
    print(f"\n{cpu['model_name']} (family {cpu['family']} model {cpu['model']}; "
          f"{' '.join(cpu['simd_flags'])}), {args.dtype}, offline")
    print(f"{'workload':>10}  {'engine tok/s':>12}  {'vLLM tok/s':>10}  {'ratio':>6}  met")
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:>10}  error: {r['error']}")
            continue
        print(f"{r['workload']:>10}  {r['engine_tok_s']:12.1f}  {r['vllm_tok_s']:10.1f}  "
              f"{r['ratio']:6.2f}  {'yes' if r['met'] else 'no'}")
    print(f"wrote {path.relative_to(ROOT)}; all met: {summary['all_met']}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
