"""Every served family on one shape: the engine's speed and memory per family (issue 37 §7).

Run from the repository root:

    .venv/bin/python bench/families.py                                  # standard workload
    .venv/bin/python bench/families.py --families llama,gemma2 --dtype bfloat16
    .venv/bin/python bench/families.py --num-requests 4 --max-prompt 64 --min-output 4 \\
        --max-output 8                                                  # a smoke run

Each family is a random checkpoint of one common shape with that family's own features on
(`FAMILY_SHAPE` and `FAMILY_FEATURES` in bench/common/model_folders.py: the `family-<name>`
model configs, so `bench/engine_throughput.py --model-config family-gemma2` runs one of them
alone), built once and cached. For each family this runs `bench/engine_throughput.py --systems
engine` on the standard workload, offline (one generate over every request: output tok/s) and
online (Poisson arrivals: TTFT and TPOT p50/p99), each mode in a fresh interpreter, one family
after the other; then prints one table (parameters, weight and KV bytes, peak RSS, speed) and writes
bench/results/families-<machine tag>-<dtype>[-smoke].json with the machine's CPU model and
flags. Workload flags other than the standard's make it a smoke run (the file name says so).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_family_model, machine_info, simd_flags  # noqa: E402
from bench.common.model_folders import (  # noqa: E402
    FAMILY_FEATURES,
    FAMILY_SHAPE,
    dtype_bytes,
    kv_bytes_per_token,
)
from bench.common.throughput_report import fmt  # noqa: E402
from bench.common.workload import WORKLOADS  # noqa: E402

FAMILIES = tuple(FAMILY_FEATURES)
# engine_throughput flags passed through where given (its defaults are the standard workload's)
PASSED = ("workload", "num_requests", "min_prompt", "max_prompt", "min_output", "max_output",
          "rate", "threads", "device", "kv_cache_mib", "timeout")


def model_config(family: str) -> str:
    return f"family-{family}"


# ----------------------------------------------------------------------------- sizes


def checkpoint_sizes(path: Path) -> dict[str, int]:
    """Parameters in the checkpoint (a tied matrix once) and, for a mixture of experts, those
    one token uses: every non-expert tensor plus top-k / experts of the experts' tensors."""
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    total = experts = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                n = math.prod(f.get_slice(name).get_shape())
                total += n
                if ".experts." in name:
                    experts += n
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    active = total
    if experts and num_experts:
        active = total - experts + experts * cfg["num_experts_per_tok"] // num_experts
    return {"params": total, "active_params": active}


def windows_of(path: Path) -> list[int | None]:
    """Each layer's sliding window as the engine reads it (None: full attention)."""
    from transformers import AutoConfig

    from workers.runner.models.registry import family_of

    config = AutoConfig.from_pretrained(path)
    return list(family_of(config).arch(config).windows or [None] * config.num_hidden_layers)


def window_text(windows: list[int | None]) -> str:
    """'4096 x6/12' (the window, on how many of the layers) or '-' for none."""
    sizes = collections.Counter(w for w in windows if w is not None)
    if not sizes:
        return "-"
    return ", ".join(f"{w} x{n}/{len(windows)}" for w, n in sorted(sizes.items()))


# ----------------------------------------------------------------------------- machine


def machine_tag(machine: dict[str, Any]) -> str:
    """A short name for the machine: the GPU's where one ran, else the CPU generation
    (AMD: zen1-5 from family and model; Intel: xeon<model>), else the CPU's model name."""
    if machine.get("gpu"):
        return slug(re.sub(r"(?i)nvidia", "", machine["gpu"]))
    fm = re.fullmatch(r"family (\d+) model (\d+)", machine.get("cpu_family_model") or "")
    name = machine.get("cpu", "")
    if fm:
        family, model = int(fm[1]), int(fm[2])
        if "AMD" in name:
            if family == 23:
                return "zen2" if model >= 0x30 else "zen1"
            if family == 25:
                zen4 = (0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F
                        or 0xA0 <= model <= 0xAF)
                return "zen4" if zen4 else "zen3"
            if family == 26:
                return "zen5"
        if "Intel" in name and family == 6:
            return f"{'xeon' if 'Xeon' in name else 'intel'}{model}"
    return slug(name) or "cpu"


def slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|@.*$|\b(cpu|processor|\d+-core)\b", " ", text, flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ----------------------------------------------------------------------------- runs


def engine_throughput_argv(args: argparse.Namespace, family: str, out: Path) -> list[str]:
    argv = [sys.executable, str(ROOT / "bench" / "engine_throughput.py"),
            "--model-config", model_config(family), "--systems", "engine", "--mode", args.mode,
            "--results", str(out)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    for key in PASSED:
        value = getattr(args, key)
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def run_family(args: argparse.Namespace, family: str, tmp: Path) -> dict[str, Any]:
    """One family's engine_throughput run; its progress lines echoed, its log kept."""
    out, log = tmp / f"{family}.json", tmp / f"{family}.log"
    argv = engine_throughput_argv(args, family, out)
    print(f"[{family}] {' '.join(Path(a).name if i < 2 else a for i, a in enumerate(argv))}",
          flush=True)
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT)
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            if args.verbose or line.startswith("[engine/"):
                print(f"[{family}] {line.rstrip()}", flush=True)
        rc = proc.wait()
    report = json.loads(out.read_text()) if out.is_file() else None
    if report is None or rc != 0:
        tail = log.read_text().splitlines()[-25:]
        print(f"[{family}] FAILED (exit {rc})", *tail, sep="\n  ", flush=True)
    print(f"[{family}] {time.perf_counter() - t0:.0f} s", flush=True)
    return {"rc": rc, "report": report}


def family_row(family: str, report: dict[str, Any] | None, rc: int) -> dict[str, Any]:
    """What the table and the JSON keep of one family's run."""
    architecture = FAMILY_FEATURES[family][0]
    row: dict[str, Any] = {"family": family, "architecture": architecture,
                           "model_config": model_config(family)}
    if report is None:
        row["error"] = f"engine_throughput exited {rc} and wrote no result"
        return row
    path, dtype = Path(report["model_path"]), report["dtype"]
    sizes = checkpoint_sizes(path)
    windows = windows_of(path)
    row.update(sizes, dtype=dtype, model_path=str(path),
               weight_bytes=sizes["params"] * dtype_bytes(dtype),
               kv_bytes_per_token=kv_bytes_per_token(path, dtype),
               windows=windows, window=window_text(windows),
               features=FAMILY_FEATURES[family][1])
    modes = {r["mode"]: r for r in report["results"] if r["system"] == "engine"}
    errors = [f"{m}: {r['error']}" for m, r in modes.items() if "error" in r]
    if errors:
        row["error"] = "; ".join(errors)
    keep = ("output_tok_s", "prompt_tok_s", "wall_s", "load_s", "ttft_p50", "ttft_p99",
            "tpot_p50", "tpot_p99", "engine_ttft_p50", "engine_ttft_p99", "engine_tpot_p50",
            "engine_tpot_p99", "peak_rss_mib", "peak_rss_children_mib", "peak_gpu_mib",
            "lengths_ok", "other_cpu_load")
    for mode, r in modes.items():
        row[mode] = {k: r[k] for k in keep if k in r}
    rss = [r["peak_rss_mib"] for r in modes.values() if r.get("peak_rss_mib")]
    row["peak_rss_mib"] = max(rss) if rss else None
    gpu = [r["peak_gpu_mib"] for r in modes.values() if r.get("peak_gpu_mib")]
    if gpu:
        row["peak_gpu_mib"] = max(gpu)
    return row


# ----------------------------------------------------------------------------- table


def print_table(result: dict[str, Any]) -> None:
    m, w = result["machine"], result["workload"]
    where = m.get("gpu") or f"{m['cpu']} ({m.get('cpu_family_model')}; {m['affinity']} cores)"
    print(f"\nfamilies  {result['date']}  {where}  dtype={result['dtype']}"
          f"{'' if result['standard_workload'] else '  (SMOKE: not the standard workload)'}")
    if w:
        longest = w["prompt_tokens"]["max"] + w["output_tokens"]["max"]
        print(f"workload: {w['num_requests']} requests, prompt {w['prompt_tokens']['min']}-"
              f"{w['prompt_tokens']['max']} tok, output {w['output_tokens']['min']}-"
              f"{w['output_tokens']['max']} tok, online {w['rate_req_s']} req/s; "
              f"sequences <= {longest} tok (a window binds only past its length)")
    s = result["shape"]
    print(f"shape: hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, "
          f"{s['num_attention_heads']} heads of {s['head_dim']} ({s['num_key_value_heads']} KV),"
          f" MLP {s['intermediate_size']} (MoE: 8 experts of 192, top 2), vocab "
          f"{s['vocab_size']}, tied embeddings")
    gpu = any(r.get("peak_gpu_mib") for r in result["families"])
    head = ["family", "architecture", "params M", "weights MiB", "KV B/tok", "window",
            "RSS MiB", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    widths = [9, 19, 11, 11, 8, 14, 7, 9, 8, 8, 8, 8]
    if gpu:
        head.append("GPU MiB")
        widths.append(7)
    print("  ".join(h.rjust(wd) if i > 1 else h.ljust(wd)
                    for i, (h, wd) in enumerate(zip(head, widths, strict=True))))
    print("  ".join("-" * wd for wd in widths) + "   (TTFT/TPOT in ms, online)")
    for r in result["families"]:
        if "params" not in r:
            print(f"{r['family']:<9}  {r['architecture']:<19}  error: {r.get('error')}")
            continue
        params = f"{r['params'] / 1e6:.1f}"
        if r["active_params"] != r["params"]:
            params += f" ({r['active_params'] / 1e6:.0f})"
        off, on = r.get("offline", {}), r.get("online", {})
        cells = [r["family"], r["architecture"], params, f"{r['weight_bytes'] / 2**20:.0f}",
                 str(r["kv_bytes_per_token"]), r["window"], fmt(r.get("peak_rss_mib"), 1, 0),
                 fmt(off.get("output_tok_s")), fmt(on.get("ttft_p50"), 1e3, 0),
                 fmt(on.get("ttft_p99"), 1e3, 0), fmt(on.get("tpot_p50"), 1e3),
                 fmt(on.get("tpot_p99"), 1e3)]
        if gpu:
            cells.append(fmt(r.get("peak_gpu_mib"), 1, 0))
        print("  ".join(c.rjust(wd) if i > 1 else c.ljust(wd)
                        for i, (c, wd) in enumerate(zip(cells, widths, strict=True))))
        if r.get("error"):
            print(f"{'':<9}  error: {r['error']}")
    print("\nparams M: in the checkpoint (active per token in brackets); weights: params x "
          f"{result['dtype']}; KV B/tok: K and V of one token, all layers; RSS: peak of the "
          "offline and online processes; out tok/s: offline")
    busy = {r["family"]: "/".join(f"{r[m]['other_cpu_load']:.1f}" for m in ("offline", "online")
                                  if "other_cpu_load" in r.get(m, {}))
            for r in result["families"]
            if any(r.get(m, {}).get("other_cpu_load", 0.0) > 0.2 for m in ("offline", "online"))}
    if busy:
        print("warning: other processes kept CPU cores busy (cores, offline/online: "
              + ", ".join(f"{f} {v}" for f, v in busy.items()) + "): those numbers are not clean")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = "(default %(default)s)"
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated subset of {', '.join(FAMILIES)} (default: all)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="engine dtype (default engine_throughput's: float32 on CPU, bfloat16 "
                        "on CUDA); the checkpoints are bf16 either way")
    p.add_argument("--mode", choices=("offline", "online", "both"), default="both", help=d)
    p.add_argument("--workload", choices=tuple(WORKLOADS), default=None,
                   help="engine_throughput's workload (default standard)")
    p.add_argument("--num-requests", type=int, default=None, help="shrink for a smoke run")
    p.add_argument("--min-prompt", type=int, default=None)
    p.add_argument("--max-prompt", type=int, default=None)
    p.add_argument("--min-output", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="online arrivals, req/s (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    p.add_argument("--kv-cache-mib", type=float, default=None,
                   help="engine KV budget (default: every request at full length at once)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per family and mode (engine_throughput's default 3600)")
    p.add_argument("--tag", default=None,
                   help="machine tag in the results file name (default: from the CPU or GPU)")
    p.add_argument("--results", default=None, help="JSON path (default under bench/results/)")
    p.add_argument("--verbose", action="store_true", help="echo engine_throughput's output")
    args = p.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        p.error(f"unknown families {unknown} (choose from {', '.join(FAMILIES)})")
    args.family_list = families
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, reports = [], {}
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        for family in args.family_list:
            run = run_family(args, family, Path(tmp))
            reports[family] = run["report"]
            rows.append(family_row(family, run["report"], run["rc"]))
    done = [r for r in reports.values() if r]
    first = done[0] if done else {}
    machine = dict(first.get("machine") or machine_info(args.device or "cpu"))
    machine.update(cpu_family_model=cpu_family_model(), simd_flags=simd_flags())
    dtype = first.get("dtype") or args.dtype or "unknown"
    standard = bool(done) and all(r.get("standard_workload") for r in done)
    result = {
        "benchmark": "families",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "standard_workload": standard,
        "workload_name": first.get("workload_name"),
        "machine": machine,
        "dtype": dtype,
        "threads": first.get("threads"),
        "shape": FAMILY_SHAPE,
        "workload": first.get("workload"),
        "families": rows,
        "engine_throughput": reports,  # each family's whole report
    }
    name = f"families-{args.tag or machine_tag(machine)}-{dtype}" + ("" if standard else "-smoke")
    out = Path(args.results) if args.results else ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    print_table(result)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
