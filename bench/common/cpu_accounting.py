"""The CPU a benchmark's child process tree used, and what other processes used meanwhile
(bench/engine_throughput.py's busy-core warning): numbers taken while other processes kept
cores busy are not clean."""

from __future__ import annotations

import resource
import subprocess
import time
from typing import IO


def busy_cpu_seconds() -> float:
    """Machine-wide non-idle CPU seconds, to tell how much other processes ran meanwhile."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def run_counting_cpu(argv: list[str], timeout_s: float, out: IO[str] | None,
                     env: dict[str, str] | None) -> float:
    """Run a system's child to its end; the CPU seconds its whole process tree used.

    `RUSAGE_CHILDREN` counts only descendants that were waited for, and vLLM's engine core
    is a grandchild its parent does not always reap, so its work looked like another
    process's load. The tree is sampled every 0.2 s instead (a process's last sample counts;
    what one does in its final 0.2 s is missed), and the rusage figure is the floor."""
    import psutil

    ru0 = children_cpu_seconds()
    seen: dict[int, float] = {}
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                            env=env)
    deadline = time.monotonic() + timeout_s
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                except psutil.Error:
                    continue
                seen[p.pid] = t.user + t.system
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(argv, timeout_s)
            time.sleep(0.2)
    except psutil.NoSuchProcess:
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return max(sum(seen.values()), children_cpu_seconds() - ru0)


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (our own system runs)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime
