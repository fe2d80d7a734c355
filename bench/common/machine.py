"""What a benchmark ran on, for the recorded results."""

from __future__ import annotations

import os
import platform
from typing import Any

from workers.runner.cbuild import cpu_flags, cpuinfo_line


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" elsewhere)."""
    line = cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line else "unknown"


def cpu_family_model() -> str | None:
    """``lscpu``'s "family F model M" (what tells CPU generations apart behind one name)."""
    family, model = cpuinfo_line("cpu family"), cpuinfo_line("model\t")
    if not family or not model:
        return None
    return f"family {family.split(':', 1)[1].strip()} model {model.split(':', 1)[1].strip()}"


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16")


def simd_flags() -> list[str]:
    """Which of the vector extensions that decide CPU kernel paths this CPU reports."""
    present = cpu_flags()
    return [f for f in SIMD_FLAGS if f in present]


def machine_info(device: str) -> dict[str, Any]:
    """What the numbers were measured on (GPU name is filled in from a child)."""
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "device": device,
            "python": platform.python_version(), "hostname": platform.node()}


def measure_copy_bandwidth(device: str, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Memory bandwidth in bytes/s from a large tensor copy (read + write both count).

    On CUDA, timed with events over `nbytes`; on CPU, the best of `iters` copies of a
    256 MiB buffer (far past any cache), timed on the wall clock."""
    import time

    import torch

    if not device.startswith("cuda"):
        src = torch.ones(min(nbytes, 1 << 28) // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(iters):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return 2 * src.numel() * 4 / best
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds
