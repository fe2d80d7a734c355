"""CPU decode attention: the two choices behind the torch backend's gathers, timed in one process.

1. Layout: SDPA over a group's context as the token-major pool gave it (`[rows, context, heads,
   dim]` viewed as `[rows, heads, context, dim]`, strided) vs contiguous per head (what the
   `[blocks, kv_heads, block_size, dim]` pool gathers to).
2. Buffers: one layer's `paged_attention` over a decode batch with a fresh tensor per gather
   vs the runner's reused `GatherWorkspace`.

Each pair runs interleaved (rounds of both, median of medians), so a shared machine's drift
hits both sides alike.

Usage: .venv/bin/python bench/archive/decode_gather.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `workers` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common.timing import interleaved  # noqa: E402
from workers.runner.attention import GatherWorkspace, build_metadata, paged_attention  # noqa: E402

BLOCK, KV_HEADS, HEADS, DIM = 16, 3, 9, 64  # SmolLM2-135M


def layout_case(rows: int, context: int) -> tuple[Callable[[], object], Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(rows, context, KV_HEADS, DIM, generator=g)
    v = torch.randn(rows, context, KV_HEADS, DIM, generator=g)
    q = torch.randn(rows, KV_HEADS, HEADS // KV_HEADS, DIM, generator=g)
    mask = torch.zeros(rows, 1, 1, context)
    k_strided, v_strided = k.transpose(1, 2), v.transpose(1, 2)
    k_cont, v_cont = k_strided.contiguous(), v_strided.contiguous()
    return (lambda: F.scaled_dot_product_attention(q, k_strided, v_strided, attn_mask=mask),
            lambda: F.scaled_dot_product_attention(q, k_cont, v_cont, attn_mask=mask))


def buffers_case(rows: int, lo: int, hi: int) -> tuple[Callable[[], object], Callable[[], object]]:
    rng = random.Random(0)
    lens = sorted(rng.randint(lo, hi) for _ in range(rows))
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 1
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = [(n - 1, 1, [free.pop() for _ in range(-(-n // BLOCK))]) for n in lens]
    k_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM)
    v_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, DIM)
    q = torch.randn(rows, HEADS, DIM)
    cpu = torch.device("cpu")
    fresh = build_metadata(seqs, BLOCK, KV_HEADS, HEADS // KV_HEADS, cpu)
    reused = build_metadata(seqs, BLOCK, KV_HEADS, HEADS // KV_HEADS, cpu,
                            workspace=GatherWorkspace())
    return (lambda: paged_attention(q, q, q, k_cache, v_cache, fresh, DIM**-0.5, BLOCK),
            lambda: paged_attention(q, q, q, k_cache, v_cache, reused, DIM**-0.5, BLOCK))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    print("SDPA over one decode group (16 rows), ms:")
    print(f"{'context':>8} {'strided':>9} {'contiguous':>11} {'speed-up':>9}")
    for context in (256, 512, 1024):
        a, b = interleaved(*layout_case(16, context), args.rounds)
        print(f"{context:>8} {a:>9.3f} {b:>11.3f} {a / b:>8.2f}x")
    print("\npaged_attention, one layer, decode rows of SmolLM2, ms:")
    print(f"{'rows':>5} {'context':>9} {'fresh':>8} {'workspace':>10} {'speed-up':>9}")
    for rows, lo, hi in ((64, 100, 750), (32, 300, 750), (64, 32, 200)):
        a, b = interleaved(*buffers_case(rows, lo, hi), args.rounds)
        print(f"{rows:>5} {f'{lo}-{hi}':>9} {a:>8.2f} {b:>10.2f} {a / b:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
