"""bench/gpu_check.py on a CPU: what travels to a lent GPU machine (the wheels against the
engine's and the CUDA tests' imports), the parts' budget and process handling, the decode
bandwidth arithmetic, the report, and a tiny end-to-end run of the benchmark parts."""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from bench import gpu_check
from bench.common import device_image, gpu_bench, model_folders

ROOT = Path(__file__).resolve().parents[2]


# ---- what travels -------------------------------------------------------------------------


def imported_test_helpers(files: list[Path], package: str = "tests.") -> list[Path]:
    """`files` and the modules of `package` they import, transitively (the tests' helpers;
    the benchmark modules the check runs)."""
    seen: dict[Path, None] = {}
    todo = list(files)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen[f] = None
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith(package):
                    path = ROOT / (name.replace(".", "/") + ".py")
                    todo += [path] if path.is_file() else []
    return list(seen)


def carried(module: str) -> str | None:
    """Why `module` is fine on the device, or None."""
    dist = device_image.owner(module)
    if dist in device_image.DEVICE_IMAGE:
        return "image"
    if dist in {device_image.normalize(n) for n in device_image.GPU_WHEELS}:
        return "wheel"
    if any(module == m or module.startswith(m + ".") for m in device_image.NOT_CARRIED):
        return "not carried"
    return None


def engine_and_test_files() -> list[Path]:
    """The engine, the CUDA test files with their helpers, and the benchmark code the check
    runs (bench/gpu_check.py and bench/engine_throughput.py, with their bench.* modules)."""
    tests = [*gpu_check.cuda_test_files(), ROOT / "tests" / "conftest.py"]
    benches = [ROOT / "bench" / "gpu_check.py", ROOT / "bench" / "engine_throughput.py"]
    return (sorted(ROOT.glob("workers/**/*.py")) + imported_test_helpers(tests)
            + imported_test_helpers(benches, "bench."))


def test_every_third_party_import_of_the_engine_and_the_cuda_tests_travels_or_is_there():
    modules = device_image.third_party(device_image.imported_modules(engine_and_test_files()))
    assert {"torch", "pydantic.BaseModel", "starlette.testclient.TestClient"} <= modules
    # the gateway's own dependencies do not travel: no CUDA test file imports it at the top
    for f in gpu_check.cuda_test_files():
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                    a.name for a in node.names]
                assert not any(n.split(".")[0] in ("gateway", "tenancy", "caching", "billing")
                               for n in names), f
    missing = sorted(m for m in modules if carried(m) is None)
    assert not missing, f"neither on the device image nor in GPU_WHEELS: {missing} " \
                        f"(owners {[device_image.owner(m) for m in missing]})"


def test_each_wheel_is_pinned_to_what_runs_here_needed_and_complete():
    wheels = {device_image.normalize(n): v for n, v in device_image.gpu_wheels().items()}
    for name in wheels:
        assert name not in device_image.DEVICE_IMAGE, f"{name} is on the image already"
    available = set(wheels) | device_image.DEVICE_IMAGE
    for name in wheels:
        missing = device_image.requirements(name) - available
        assert not missing, f"{name} needs {missing}, neither a wheel nor on the image"
    imported = {device_image.owner(m) for m in device_image.third_party(
        device_image.imported_modules(engine_and_test_files()))}
    required = {r for name in wheels for r in device_image.requirements(name)}
    plugins = {device_image.normalize(n) for n in device_image.PYTEST_PLUGINS}
    strays = set(wheels) - imported - required - plugins
    assert not strays, f"wheels nothing imports or requires: {strays}"


def test_the_pytest_plugins_the_config_asks_for_are_there():
    text = (ROOT / "pyproject.toml").read_text()
    have = device_image.DEVICE_IMAGE | {device_image.normalize(n)
                                        for n in device_image.GPU_WHEELS}
    for plugin, option in device_image.PYTEST_PLUGINS.items():
        assert re.search(rf"^{option}\s*=", text, re.MULTILINE), option
        assert plugin in have, plugin


def test_download_asks_for_cpython_3_12_wheels_for_x86_64_linux_only():
    cmd = device_image.download_command(Path("/x"), "pydantic==1")
    assert cmd[-1] == "pydantic==1" and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert platforms and all(p.endswith("x86_64") for p in platforms)
    install = device_image.install_command([Path("a.whl")], Path("/t"))
    assert {"--no-index", "--no-deps", "--target"} <= set(install) and install[-1] == "a.whl"


def test_prepare_fetches_each_wheel_once_drops_stale_ones_and_copies_the_tokenizer(
        tmp_path, monkeypatch, smollm2_path):
    calls = []

    def fake_run(cmd, check):
        spec = cmd[-1]
        name, version = spec.split("==")
        dest = Path(cmd[cmd.index("-d") + 1])
        calls.append(spec)
        (dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"x")

    monkeypatch.setattr(device_image.subprocess, "run", fake_run)
    dest = tmp_path / ".whl"
    dest.mkdir()
    (dest / "pydantic-0.1-py3-none-any.whl").write_bytes(b"old")  # another version: stale
    pins = device_image.gpu_wheels()
    keep = f"redis-{pins['redis']}-py3-none-any.whl"
    (dest / keep).write_bytes(b"have")
    result = device_image.prepare(dest, tokenizer_source=smollm2_path)
    assert "redis==" + pins["redis"] not in calls  # already there
    assert len(calls) == len(device_image.GPU_WHEELS) - 1
    assert not (dest / "pydantic-0.1-py3-none-any.whl").exists()
    assert (dest / keep).read_bytes() == b"have"
    tokenizer = dest / "smollm2-tokenizer"
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {
        p.name for p in tokenizer.iterdir()}
    assert not list(tokenizer.glob("*.safetensors"))  # the weights never travel
    assert result["bytes"] < device_image.WHEEL_BUDGET_BYTES


def test_the_wheel_folder_is_ignored_by_git():
    proc = subprocess.run(["git", "check-ignore", "-q", ".whl/x.whl"], cwd=ROOT)
    assert proc.returncode == 0


def test_make_targets_prepare_and_run_the_check():
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^gpu-wheels:.*\n\t.*bench/gpu_check\.py prepare", text, re.MULTILINE)
    assert re.search(r"^gpu-check:.*\n\t.*bench/gpu_check\.py run --out \$\(OUT\)", text,
                     re.MULTILINE)


# ---- which tests run there ----------------------------------------------------------------


def test_cuda_test_files_are_the_files_with_cuda_tests():
    files = {f.relative_to(ROOT).as_posix() for f in gpu_check.cuda_test_files()}
    expected = {
        "tests/workers/runner/test_triton_decode.py", "tests/workers/runner/test_attention.py",
        "tests/workers/runner/test_sliding_window.py", "tests/workers/runner/test_kv_quant.py",
        "tests/workers/runner/test_quantization.py", "tests/workers/runner/test_token_mask.py",
        "tests/workers/test_llm_tiny.py", "tests/workers/test_lora_engine.py",
        "tests/workers/test_speculative.py", "tests/workers/test_structured_outputs.py",
        "tests/workers/test_async_engine.py", "tests/workers/server/test_app.py",
    }
    assert expected <= files
    # any test file naming the device helpers or the marker is in
    for f in ROOT.glob("tests/**/test_*.py"):
        if f.name == "test_gpu_check.py":  # names them in its checks
            continue
        text = f.read_text()
        if re.search(r"\b(DEVICES|TRITON_DEVICES|on_cuda)\b|mark\.cuda", text):
            assert f.relative_to(ROOT).as_posix() in files, f


def test_cuda_tests_skip_here_with_the_reason():
    """Collected and skipped cleanly without a device, each with the printed reason."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the tests run")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
         "tests/workers/runner/test_triton_decode.py", "tests/workers/runner/test_token_mask.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "needs a CUDA device (torch.cuda.is_available() is False here)" in proc.stdout
    skipped = re.search(r"(\d+) skipped", proc.stdout)
    assert skipped and int(skipped[1]) >= 15, proc.stdout[-500:]
    assert " passed" not in proc.stdout and " failed" not in proc.stdout


# ---- the parts ----------------------------------------------------------------------------


def make_check(tmp_path, **overrides) -> gpu_check.Check:
    args = gpu_check.parse_args(["run", "--out", str(tmp_path), "--device", "cpu", "--tiny",
                                 "--wheels", str(tmp_path / "none")])
    for key, value in overrides.items():
        setattr(args, key, value)
    return gpu_check.Check(args=args, out=tmp_path)


def test_a_part_runs_only_while_its_time_is_left_and_failures_are_recorded(tmp_path, capsys):
    check = make_check(tmp_path, budget_s=100.0)

    def ok(check, part):
        return {"x": 1}

    def broken(check, part):
        raise ValueError("boom")

    def not_here(check, part):
        raise gpu_check.Skip("not here")

    assert gpu_check.run_part(check, gpu_check.Part("a", 10, 60, ok))["status"] == "ok"
    assert gpu_check.run_part(check, gpu_check.Part("b", 1000, 60, ok)) | {"seconds": 0} == {
        "name": "b", "status": "skipped", "seconds": 0,
        "reason": "out of time: 100 s of the budget left, the part needs about 1000 s"}
    failed = gpu_check.run_part(check, gpu_check.Part("c", 1, 60, broken))
    assert failed["status"] == "failed" and failed["reason"] == "ValueError: boom"
    assert "ValueError: boom" in (tmp_path / "gpu_check.log").read_text()  # the traceback
    assert gpu_check.run_part(check, gpu_check.Part("d", 1, 60, not_here))["reason"] == \
        "not here"
    cuda = gpu_check.run_part(check, gpu_check.Part("e", 1, 60, ok, cuda_only=True))
    assert cuda["status"] == "skipped" and "needs CUDA" in cuda["reason"]
    printed = capsys.readouterr().out
    assert re.search(r"\[gpu-check\] a +ok +\d+\.\d s", printed)  # time per part
    assert [p["name"] for p in check.parts] == ["a", "b", "c", "d", "e"]


def test_a_part_past_its_limit_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "grandchild-alive"
    script = (f"sleep 3 && touch {marker} & sleep 30")  # a grandchild, as pytest's workers
    started = time.monotonic()
    code = gpu_check.run_logged(["sh", "-c", script], timeout=1, env=dict(os.environ),
                                log=tmp_path / "log")
    assert code == -9 and time.monotonic() - started < 10
    time.sleep(3.5)
    assert not marker.exists()  # the whole process group went
    assert "[killed after 1 s]" in (tmp_path / "log").read_text()


def test_install_puts_the_wheels_then_the_project_into_the_target(tmp_path, monkeypatch):
    wheels = tmp_path / "w"
    wheels.mkdir()
    (wheels / "redis-1-py3-none-any.whl").write_bytes(b"x")
    check = make_check(tmp_path, wheels=wheels, site=tmp_path / "site", force_install=True)
    commands = []

    def fake_run_logged(argv, *, timeout, env, log, cwd=ROOT):
        commands.append(argv)
        return 0

    monkeypatch.setattr(gpu_check, "run_logged", fake_run_logged)
    probe = subprocess.CompletedProcess([], 0, stdout=f"{tmp_path}/site/workers/__init__.py\n",
                                        stderr="")
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: probe)
    result = gpu_check.part_install(check, gpu_check.PARTS[1])
    assert commands[0][-1] == str(wheels / "redis-1-py3-none-any.whl")
    assert {"--no-index", "--no-deps", "--target"} <= set(commands[1])
    assert commands[1][-1] == str(ROOT) and "--no-build-isolation" in commands[1]
    assert check.env["PYTHONPATH"] == str(tmp_path / "site")
    assert result["imported_from"].startswith(str(tmp_path / "site"))
    empty = make_check(tmp_path, wheels=tmp_path / "none")
    with pytest.raises(gpu_check.Skip, match="no wheels"):
        gpu_check.part_install(empty, gpu_check.PARTS[1])
    assert gpu_check.missing_distributions() == []  # this venv has them all
    with pytest.raises(gpu_check.Skip, match="has every package"):
        gpu_check.part_install(make_check(tmp_path, wheels=wheels), gpu_check.PARTS[1])


def test_a_decode_part_killed_midway_keeps_the_batch_sizes_it_measured(tmp_path, monkeypatch):
    check = make_check(tmp_path)
    check.base = tmp_path
    part = next(p for p in gpu_check.PARTS if p.name == "decode_8b")

    def killed_child(argv, *, timeout, env, log, cwd=ROOT):
        out = Path(argv[argv.index("--json-out") + 1])
        assert argv[argv.index("--base") + 1] == str(tmp_path)
        out.write_text(json.dumps({"rows": [{"batch": 1}], "partial": True}))
        return -9

    monkeypatch.setattr(gpu_check, "run_logged", killed_child)
    record = gpu_check.run_part(check, part)
    assert record["status"] == "partial" and record["reason"] == "killed at the time limit"
    assert record["result"]["rows"] == [{"batch": 1}]
    assert check.result("decode_8b") == record["result"]


JUNIT = ('<testsuites><testsuite tests="3" failures="{f}" errors="0" skipped="0">'
         '<testcase classname="tests.a" name="test_ok"/><testcase classname="tests.a" '
         'name="test_b">{failure}</testcase><testcase classname="tests.a" name="test_c"/>'
         '</testsuite></testsuites>')


@pytest.mark.parametrize("failing", [False, True])
def test_the_cuda_tests_part_runs_pytest_on_the_cuda_files_and_reads_its_report(
        tmp_path, monkeypatch, failing):
    check = make_check(tmp_path, device="cuda", budget_s=300.0)
    seen = []

    def fake_pytest(argv, *, timeout, env, log, cwd=ROOT):
        seen.append((argv, timeout))
        xml = Path(next(a for a in argv if a.startswith("--junitxml="))[len("--junitxml="):])
        xml.write_text(JUNIT.format(f=int(failing), failure='<failure message="boom"/>'
                                    if failing else ""))
        log.write_text("3 passed in 1.0s\n" if not failing else "1 failed, 2 passed\n")
        return int(failing)

    monkeypatch.setattr(gpu_check, "run_logged", fake_pytest)
    record = gpu_check.run_part(check, next(p for p in gpu_check.PARTS
                                            if p.name == "cuda_tests"))
    argv, timeout = seen[0]
    assert argv[1:5] == ["-m", "pytest", "-m", "cuda"] and "-rs" in argv
    assert "tests/workers/runner/test_triton_decode.py" in argv
    assert timeout == pytest.approx(180, abs=1)  # the part's cap, under the budget left
    session = next(a for a in argv if a.startswith("session_timeout="))
    assert int(session.split("=")[1]) == pytest.approx(160, abs=1)
    assert record["status"] == ("failed" if failing else "ok")
    assert record["result"]["passed"] == 3 - failing
    if failing:
        assert record["result"]["failing"] == [{"test": "tests.a::test_b", "kind": "failure",
                                                "message": "boom"}]


def test_junit_summary_counts_and_names_the_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="assert 1 == 2">'
        'long</failure></testcase>'
        '<testcase classname="tests.b" name="test_err"><error message="CUDA error: boom"/>'
        '</testcase><testcase classname="tests.b" name="test_skip"><skipped/></testcase>'
        '</testsuite></testsuites>')
    summary = gpu_check.junit_summary(xml)
    assert {k: summary[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    assert summary["failing"] == [
        {"test": "tests.a::test_bad", "kind": "failure", "message": "assert 1 == 2"},
        {"test": "tests.b::test_err", "kind": "error", "message": "CUDA error: boom"}]


# ---- the benchmark's arithmetic -----------------------------------------------------------


def test_bandwidth_row_is_bytes_read_per_step_over_step_time_over_copy_bandwidth():
    # 16 GB of weights, batch 8 at context 336 of 128 KiB per token: 16.352 GB a step
    row = gpu_bench.bandwidth_row(8, 0.008, 16_000_000_000, 131072, 336.0, 3.0e12)
    assert row["bytes_per_step"] == 16_000_000_000 + 8 * 336 * 131072
    assert row["achieved_gb_s"] == pytest.approx(row["bytes_per_step"] / 0.008 / 1e9)
    assert row["utilisation"] == pytest.approx(row["bytes_per_step"] / 0.008 / 3.0e12)
    assert row["step_ms"] == pytest.approx(8.0)
    assert gpu_bench.bandwidth_row(1, 0.0, 10, 1, 1.0, 1.0)["utilisation"] is None
    assert gpu_bench.bandwidth_row(1, 0.01, 10, 1, 1.0, None)["utilisation"] is None


class FakeLLM:
    """generate() costs 5 ms plus 2 ms a token, on a fake clock."""

    def __init__(self, clock):
        self.clock = clock
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.max_tokens))
        self.clock.now += 0.005 + 0.002 * params.max_tokens
        return []


class FakeClock:
    now = 0.0

    def __call__(self):
        return self.now


def test_measure_decode_takes_the_step_from_two_lengths_and_stops_at_the_deadline(
        tokenizer):
    from workers import SamplingParams

    clock = FakeClock()
    llm = FakeLLM(clock)
    seen = []
    # each batch size takes 0.071 s of the fake clock: batch 8 would end past 0.15
    rows, skipped = gpu_bench.measure_decode(
        llm, SamplingParams, tokenizer, batches=[1, 4, 8], prompt_len=12, short=4, long=20,
        device="cpu", weight_bytes=1000, kv_bytes_per_token=10, copy_bytes_per_s=1e6,
        deadline=0.15, clock=clock, on_row=lambda rows: seen.append(len(rows)))
    assert [r["batch"] for r in rows] == [1, 4] and skipped == [{"batch": 8,
                                                                  "reason": "out of time"}]
    assert seen == [1, 2]
    assert rows[0]["step_ms"] == pytest.approx(2.0)
    assert rows[1]["bytes_per_step"] == 1000 + 4 * (12 + 12) * 10
    assert llm.calls[:3] == [(1, 4), (1, 4), (1, 20)]  # a warm-up run, then the two lengths
    with pytest.raises(ValueError):
        gpu_bench.measure_decode(llm, SamplingParams, tokenizer, batches=[1], prompt_len=4,
                                 short=8, long=8, device="cpu", weight_bytes=1,
                                 kv_bytes_per_token=1, copy_bytes_per_s=None)


def test_the_check_models_have_the_real_shapes():
    expect = {"smollm2-135m": 134_515_008, "llama-3.2-1b": 1_235_814_400,
              "llama-3.1-8b": 8_030_261_248}
    for name, params in expect.items():
        spec = dict(model_folders.MODEL_CONFIGS[name])
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec))
        assert sum(p.numel() for p in model.parameters()) == params, name


def test_tiled_safetensors_read_back_as_written(tmp_path):
    from safetensors import safe_open

    shapes = {"a.weight": (3, 5), "model.norm.weight": (5,), "b.weight": (7, 11)}
    path = tmp_path / "m.safetensors"
    model_folders.write_tiled_safetensors(path, shapes, norm_value=0.0, pool_elements=16)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(shapes)
        tensors = {k: f.get_tensor(k) for k in shapes}
    assert all(t.dtype == torch.bfloat16 and tuple(t.shape) == shapes[k]
               for k, t in tensors.items())
    assert torch.equal(tensors["model.norm.weight"], torch.zeros(5, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    pool = torch.empty(16, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
    flat = tensors["b.weight"].flatten()  # 77 values: runs of the pool from its offset
    start = (2 * 2654435761) % 16
    expected = torch.cat([pool, pool] * 4)[start : start + 77]
    assert torch.equal(flat, expected)
    assert tensors["a.weight"].float().std() > 0.005


def test_standard_argv_and_summary():
    offline = gpu_bench.standard_argv("offline", device="cuda", tiny=False,
                                      results=Path("/r.json"), timeout=99)
    assert offline[offline.index("--systems") + 1] == "engine,hf_batch"
    assert offline[offline.index("--model-config") + 1] == "smollm2-135m"
    assert "--no-bandwidth" in offline and "--num-requests" not in offline  # the standard one
    online = gpu_bench.standard_argv("online", device="cpu", tiny=True,
                                     results=Path("/r.json"), timeout=5)
    assert online[online.index("--mode") + 1] == "online"
    assert online[online.index("--model-config") + 1] == "gpu-check-tiny"
    report = {"model": "m", "results": [
        {"system": "engine", "mode": "offline", "output_tok_s": 1200.0, "heads": [[1]]},
        {"system": "hf_batch", "mode": "offline", "output_tok_s": 200.0}]}
    summary = gpu_bench.standard_summary(report)
    assert summary["engine_over_hf_batch"] == pytest.approx(6.0)
    assert "heads" not in summary["runs"][0]


def test_targets_and_the_summary_page(tmp_path):
    check = make_check(tmp_path)
    row = {"batch": 1, "step_ms": 8.0, "utilisation": 0.72, "achieved_gb_s": 2100.0}
    check.parts = [
        {"name": "machine", "status": "ok", "seconds": 1.0,
         "result": {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04",
                    "nvidia_smi": "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB",
                    "packages": {"torch": "2.11.0"}, "host": {"python": "3.12.3"}}},
        {"name": "decode_8b", "status": "ok", "seconds": 80.0,
         "result": {"shape": "llama-8b", "model": "llama-3.1-8b", "rows": [row],
                    "skipped_batches": [{"batch": 64, "reason": "out of time"}],
                    "prompt_len": 256, "outputs": [16, 144], "weight_bytes": 16e9,
                    "copy_gb_s": 2900.0, "build_s": 10.0, "load_s": 9.0}},
        {"name": "decode_smollm2", "status": "skipped", "seconds": 0.0,
         "reason": "out of time"},
        {"name": "standard_offline", "status": "ok", "seconds": 50.0,
         "result": {"model": "smollm2-135m", "engine_over_hf_batch": 4.5,
                    "runs": [{"system": "engine", "mode": "offline", "output_tok_s": 900.0}]}},
    ]
    rep = gpu_check.report(check)
    met = {t["key"]: (t["value"], t["met"]) for t in rep["targets"]}
    assert met == {"decode_8b_batch1_utilisation": (0.72, True),
                   "smollm2_batch1_step_ms": (None, None),
                   "standard_engine_over_hf": (4.5, False)}
    assert rep["gpu"] == "NVIDIA H100 80GB HBM3" and rep["driver"] == "580.159.04"
    page = gpu_check.markdown(rep)
    assert "NVIDIA H100 80GB HBM3 (driver 580.159.04" in page
    assert "| 72.0% | yes |" in page and "| 4.50x | **no** |" in page
    assert "| not measured |" in page and "skipped: out of time" in page
    assert len(page.splitlines()) < 60  # one page
    json.dumps(rep)


def test_parse_args_defaults_to_run_and_refuses_unknown_parts(tmp_path):
    args = gpu_check.parse_args(["--out", str(tmp_path), "--device", "cpu"])
    assert args.command == "run" and args.budget_s == gpu_check.DEFAULT_BUDGET_S
    assert args.cache_dir is None  # /dev/shm only on CUDA
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["run", "--skip", "nope"])
    assert gpu_check.DEFAULT_BUDGET_S + 30 <= 8 * 60  # the run ends within 8 minutes


def test_a_tiny_run_on_the_cpu_writes_the_report(tmp_path):
    """The benchmark parts end to end in their own processes, on a two-layer model: the
    models folder, decode bandwidth and the standard workload against HF's continuous
    batching."""
    out = tmp_path / "out"
    code = gpu_check.main(["run", "--out", str(out), "--device", "cpu", "--tiny",
                           "--wheels", str(tmp_path / "none"), "--cache-dir",
                           str(tmp_path / "cache"), "--budget-s", "500",
                           "--only", "machine,models,decode_smollm2,standard_offline"])
    rep = json.loads((out / "gpu_check.json").read_text())
    statuses = {p["name"]: p["status"] for p in rep["parts"]}
    assert code == 0, (out / "gpu_check.log").read_text()[-3000:]
    assert statuses == {"machine": "ok", "models": "ok", "decode_smollm2": "ok",
                        "standard_offline": "ok"}
    parts = {p["name"]: p for p in rep["parts"]}
    decode = parts["decode_smollm2"]["result"]
    assert [r["batch"] for r in decode["rows"]] == [1, 2]
    for r in decode["rows"]:  # a few tiny steps on a busy CPU: the step is noise, maybe < 0
        assert isinstance(r["step_ms"], float) and r["bytes_per_step"] > 0
        assert (r["utilisation"] > 0) if r["step_ms"] > 0 else r["utilisation"] is None

    spec = dict(model_folders.MODEL_CONFIGS[gpu_bench.TINY_MODEL])
    with torch.device("meta"):
        tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec))
    # float32 on a CPU; the tied embedding is read once, as the LM head
    assert decode["weight_bytes"] == 4 * sum(p.numel() for p in tiny.parameters())
    assert decode["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    standard = parts["standard_offline"]["result"]
    assert {r["system"] for r in standard["runs"]} == {"engine", "hf_batch"}
    assert standard["engine_over_hf_batch"] > 0
    assert math.isfinite(standard["engine_over_hf_batch"])
    page = (out / "gpu_check.md").read_text()
    assert "Tiny shapes" in page and "## Decode" in page
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log",
                                                     "gpu_check.md"]

    child = gpu_check.parse_args(["part", "models", "--json-out", "x"])
    assert isinstance(child, argparse.Namespace) and child.command == "part"


def test_hf_continuous_batching_config_fits_the_device_transformers_and_this_one():
    """transformers 5.17 (the lent machines' image) calls the page size `block_size` and has
    no `auto_switch_to_flash`; this venv's has both names as the benchmark passes them."""
    import dataclasses

    from bench.common.hf_runner import continuous_batching_config

    @dataclasses.dataclass
    class Transformers517Config:
        block_size: int = 256
        num_blocks: int | None = None

    old = continuous_batching_config(Transformers517Config, page_size=128, num_blocks=3,
                                     auto_switch_to_flash=False)
    assert (old.block_size, old.num_blocks) == (128, 3)
    new = continuous_batching_config(transformers.ContinuousBatchingConfig, page_size=128,
                                     num_blocks=3, auto_switch_to_flash=False)
    assert (new.page_size, new.num_blocks, new.auto_switch_to_flash) == (128, 3, False)


def test_engine_throughputs_decode_probe_runs_the_same_measurement(tmp_path, monkeypatch,
                                                                   smollm2_path):
    """bench/engine_throughput.py's CUDA probe: batch sizes over max_num_seqs dropped, the
    best of two timed runs per length, no warm-up run, the GPU check's rows."""
    from bench.common.engine_runner import decode_bandwidth
    from workers import SamplingParams

    monkeypatch.setenv("SWITCHBOARD_CACHE_DIR", str(tmp_path))
    path = model_folders.build_random_model(gpu_bench.TINY_MODEL, smollm2_path)
    llm = FakeLLM(FakeClock())
    args = argparse.Namespace(model_path=str(path), dtype="float32", copy_bandwidth=2e9,
                              bw_batches="1,8,32", max_num_seqs=8, bw_prompt=16, bw_short=2,
                              bw_long=6, device="cpu", seed=0)
    result = decode_bandwidth(llm, SamplingParams, args)
    assert [r["batch"] for r in result["rows"]] == [1, 8]
    assert llm.calls == [(1, 2), (1, 2), (1, 6), (1, 6), (8, 2), (8, 2), (8, 6), (8, 6)]
    assert result["copy_gb_s"] == 2.0 and result["outputs"] == [2, 6]
    assert result["weight_bytes"] == model_folders.weight_bytes_read_per_step(path, "float32")
