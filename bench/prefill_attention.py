"""One layer's attention for a prefill chunk after cached context, three ways, on CPU.

SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64), float32, a `--chunk`-token chunk
after 1-5k cached tokens, K/V already gathered (the same in every way):

- `masked`: the engine's fallback (`attention._prefill_cached`): the GQA group folded into
  the query length, an explicit `[group x chunk, context]` additive mask; SDPA's math path.
- `flash+mask`: one call of the fused flash kernel with a `[chunk, context]` mask.
- `flash split`: the engine's `flash` kernel (`flash_prefill.cached_chunk_attention`): the
  cached context and the chunk's causal part, two flash calls merged by log-sum-exp.

The ways run interleaved, best of `--repeats`. Usage:
.venv/bin/python bench/prefill_attention.py [--chunk 1024] [--contexts 1024,3072,5120]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.machine import cpu_model  # noqa: E402
from workers.runner.attention import _prefill_cached, causal_mask  # noqa: E402
from workers.runner.flash_prefill import cached_chunk_attention  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def ways(chunk: int, cached: int) -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    group, scale = HEADS // KV_HEADS, DIM**-0.5
    q = torch.randn(chunk, HEADS, DIM, generator=g)
    k_all = torch.randn(KV_HEADS, cached + chunk, DIM, generator=g)
    v_all = torch.randn(KV_HEADS, cached + chunk, DIM, generator=g)
    k_new, v_new = k_all[:, cached:].transpose(0, 1), v_all[:, cached:].transpose(0, 1)
    visible = causal_mask(cached, chunk, 1, torch.device("cpu"))
    additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def flash_mask() -> torch.Tensor:
        q4 = q.transpose(0, 1).unsqueeze(0)
        return flash(q4, k_all[None], v_all[None], 0.0, False, attn_mask=additive,
                     scale=scale)[0][0].transpose(0, 1)

    return {
        "masked": lambda: _prefill_cached(q, k_all.reshape(-1, DIM), v_all.reshape(-1, DIM),
                                          additive.repeat(group, 1), scale),
        "flash+mask": flash_mask,
        "flash split": lambda: cached_chunk_attention(
            q, k_all[:, :cached], v_all[:, :cached], k_new, v_new, scale),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--contexts", default="1024,3072,5120")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, chunk {args.chunk}")
    print("| cached tokens | masked | flash+mask | flash split | masked / split |")
    print("|---|---|---|---|---|")
    for cached in (int(c) for c in args.contexts.split(",")):
        runs = ways(args.chunk, cached)
        outs = {name: run() for name, run in runs.items()}  # warm-up, and agreement
        for name, out in outs.items():
            torch.testing.assert_close(out, outs["masked"], rtol=1e-4, atol=1e-4, msg=name)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeats):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - started)
        ms = {name: f"{t * 1e3:.0f} ms" for name, t in best.items()}
        print(f"| {cached} | {ms['masked']} | {ms['flash+mask']} | {ms['flash split']} "
              f"| {best['masked'] / best['flash split']:.1f}x |")


if __name__ == "__main__":
    main()
