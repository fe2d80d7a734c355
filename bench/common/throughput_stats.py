"""What each system's run in bench/engine_throughput.py reports: one `RequestStat` per request,
summarised the same way for every system (`summarize`), and the device sync its wall times
wait on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HEAD_TOKENS = 16  # output tokens per request kept to compare greedy outputs across systems


@dataclass
class RequestStat:
    """What one request produced and when; times in seconds, None where not measurable."""

    tokens: int
    expected: int
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None
    head: list[int] | None = None
    ids: list[int] | None = None  # every output token id, for the agreement with the engine


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for an empty list."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(stats: list[RequestStat], wall: float) -> dict[str, Any]:
    """Throughput counts only useful tokens (≤ each request's max_tokens): waste is not work."""
    useful = sum(min(s.tokens, s.expected) for s in stats)
    ttfts = [s.ttft for s in stats if s.ttft is not None]
    tpots = [s.tpot for s in stats if s.tpot is not None]
    lats = [s.latency for s in stats if s.latency is not None]
    return {
        "wall_s": wall,
        "output_tokens": useful,
        "output_tok_s": useful / wall if wall > 0 else None,
        "lengths_ok": all(s.tokens == s.expected for s in stats),
        "short_requests": sum(s.tokens < s.expected for s in stats),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
        "latency_p50": percentile(lats, 50),
        "latency_p99": percentile(lats, 99),
        "ttfts": [s.ttft for s in stats],  # per request, in workload order
        "heads": [s.head for s in stats],
        "outputs": [s.ids for s in stats],
    }


def tpot_of(times: list[float]) -> float | None:
    """Mean gap between output tokens after the first (same definition as the engine's)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def sync(device: str) -> None:
    """Wait for queued device work so wall times cover it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
