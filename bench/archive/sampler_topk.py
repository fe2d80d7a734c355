"""Top-k/top-p masking cost: the top-1024 window against a full sort of the vocabulary.

Run from the repository root: `.venv/bin/python bench/archive/sampler_topk.py`. Prints a table last.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.engine.sampling_params import SamplingParams  # noqa: E402
from workers.runner.sampler import _masked_window, _top_k_top_p  # noqa: E402

VOCAB = 49152  # SmolLM2
ROWS = (1, 16, 64)
REPEATS = 20


def timed(fn, *args) -> float:
    """Median milliseconds over REPEATS calls, after one warm-up call."""
    fn(*args)
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    torch.manual_seed(0)
    results = []
    for rows in ROWS:
        logits = torch.randn(rows, VOCAB) * 4  # peaked, like a trained model's next token
        params = [SamplingParams(top_p=0.9, top_k=50 if i % 2 else 0) for i in range(rows)]
        window = timed(_top_k_top_p, logits, params)
        full = timed(_masked_window, logits, params, VOCAB)
        results.append({"rows": rows, "window_ms": window, "full_sort_ms": full})
    out = ROOT / "bench" / "results" / "sampler_topk-cpu.json"
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2))
    print(f"{'rows':>5} {'window ms':>10} {'full sort ms':>13} {'speed-up':>9}")
    for r in results:
        ratio = r["full_sort_ms"] / r["window_ms"]
        print(f"{r['rows']:>5} {r['window_ms']:>10.2f} {r['full_sort_ms']:>13.2f} {ratio:>8.1f}x")


if __name__ == "__main__":
    main()
