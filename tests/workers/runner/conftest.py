"""Fixtures for the runner's C kernels: an empty build cache, and every build target this CPU
can run (each code path of a kernel is one of them)."""

from __future__ import annotations

import platform

import pytest

from workers.runner import cbuild, cpu_decode, cpu_fused, cpu_int8


def build_targets() -> list[str]:
    """`native` (AVX-512 intrinsics where the CPU has them), then on x86 the AVX2 target
    (where the CPU has AVX2 and FMA) and the SSE2 baseline: what other CPUs build."""
    targets = ["native"]
    if platform.machine() in ("x86_64", "AMD64"):
        if {"avx2", "fma", "bmi2"} <= cbuild.cpu_flags():
            targets.append("x86-64-v3")
        targets.append("x86-64")
    return targets


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty kernel cache, and no library loaded by an earlier test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for module in (cpu_decode, cpu_fused, cpu_int8):
        module.load_library.cache_clear()
    yield tmp_path / "switchboard" / "kernels"
    for module in (cpu_decode, cpu_fused, cpu_int8):
        module.load_library.cache_clear()
