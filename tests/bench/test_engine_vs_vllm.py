"""The one-run check of issue 23: each workload's ratio and whether it met the target."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common.machine import SIMD_FLAGS
from bench.engine_vs_vllm import TARGET, cpu_identity, ratio_row, workload_argv


def _report(engine: float | None, vllm: float | None) -> dict:
    results = []
    for system, tok_s in (("engine", engine), ("vllm_cpu", vllm)):
        results.append({"system": system, "error": "boom"} if tok_s is None
                       else {"system": system, "output_tok_s": tok_s, "prompt_tok_s": 10.0})
    return {"results": results}


def test_ratio_row_is_engine_over_vllm_and_checks_the_target() -> None:
    row = ratio_row("standard", _report(360.0, 300.0))
    assert row["ratio"] == 1.2 and row["met"] is True
    row = ratio_row("prefill", _report(350.0, 300.0))
    assert abs(row["ratio"] - 350 / 300) < 1e-12 and row["met"] is False
    assert ratio_row("long", _report(TARGET * 10, 10.0))["met"] is True  # the bound counts


def test_ratio_row_names_the_system_that_failed() -> None:
    row = ratio_row("long", _report(5.0, None))
    assert "ratio" not in row and row["error"] == "vllm_cpu: boom"


def test_workload_argv_runs_both_systems_offline_into_its_own_file() -> None:
    args = argparse.Namespace(dtype="bfloat16", engine_arg=["linear_backend=onednn"])
    argv = workload_argv(args, "long", Path("/tmp/x.json"))
    joined = " ".join(argv)
    assert "--workload long" in joined and "--systems engine,vllm_cpu" in joined
    assert "--mode offline" in joined and "--dtype bfloat16" in joined
    assert "--results /tmp/x.json" in joined and "--engine-arg linear_backend=onednn" in joined


def test_cpu_identity_has_the_fields_lscpu_shows() -> None:
    cpu = cpu_identity()
    assert set(cpu) == {"model_name", "family", "model", "simd_flags"}
    assert set(cpu["simd_flags"]) <= set(SIMD_FLAGS)
    if Path("/proc/cpuinfo").exists() and "cpu family" in Path("/proc/cpuinfo").read_text():
        assert cpu["family"].isdigit() and cpu["model"].isdigit()  # not "model name"'s text
