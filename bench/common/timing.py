"""Timing two candidates on a shared, noisy machine: interleaved, so drift hits both alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(a: Callable[[], object], b: Callable[[], object], rounds: int,
                calls: int = 10) -> tuple[float, float]:
    """Median over rounds of each side's median ms per call (one warm-up call each)."""
    def median_ms(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    a(), b()
    pairs = [(median_ms(a), median_ms(b)) for _ in range(rounds)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
