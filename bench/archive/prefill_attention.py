"""One layer's attention for a prefill chunk after cached context, several ways, on CPU.

SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64), float32 or `--dtype bfloat16`, a
`--chunk`-token chunk after 1-5k cached tokens, K/V already gathered (the same in every way):

- `masked`: the engine's fallback (`attention._prefill_cached`): the GQA group folded into
  the query length, an explicit `[group x chunk, context]` additive mask; SDPA's math path.
- `flash+mask`: one call of the fused flash kernel with a `[chunk, context]` mask.
- `flash split`: the engine's `flash` kernel (`flash_prefill.cached_chunk_attention`): the
  cached context and the chunk's causal part, two flash calls merged by log-sum-exp.
- `vec`, `amx`: the C kernels (`vec_prefill`, `amx_prefill`), where this CPU runs them;
  `vec avx2`: the vector kernel's AVX2 build, float32, on a CPU with AVX-512 too.

The ways run interleaved, best of `--repeats`; GFLOP/s counts the causal attention's
multiply-adds (4 x heads x dim x chunk x (cached + (chunk + 1) / 2)). Usage:
.venv/bin/python bench/archive/prefill_attention.py [--chunk 1024] [--contexts 1024,3072,5120]
    [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common.machine import cpu_model  # noqa: E402
from workers.runner import amx_prefill, cbuild, vec_prefill  # noqa: E402
from workers.runner.attention import _prefill_cached, causal_mask  # noqa: E402
from workers.runner.flash_prefill import cached_chunk_attention  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64


def ways(chunk: int, cached: int, dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    group, scale = HEADS // KV_HEADS, DIM**-0.5
    q = torch.randn(chunk, HEADS, DIM, generator=g).to(dtype)
    k_all = torch.randn(KV_HEADS, cached + chunk, DIM, generator=g).to(dtype)
    v_all = torch.randn(KV_HEADS, cached + chunk, DIM, generator=g).to(dtype)
    k_new, v_new = k_all[:, cached:].transpose(0, 1), v_all[:, cached:].transpose(0, 1)
    visible = causal_mask(cached, chunk, 1, torch.device("cpu"))
    additive = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def flash_mask() -> torch.Tensor:
        q4 = q.transpose(0, 1).unsqueeze(0)
        return flash(q4, k_all[None], v_all[None], 0.0, False, attn_mask=additive,
                     scale=scale)[0][0].transpose(0, 1)

    found = {
        "masked": lambda: _prefill_cached(q, k_all.reshape(-1, DIM), v_all.reshape(-1, DIM),
                                          additive.repeat(group, 1), scale),
        "flash+mask": flash_mask,
        "flash split": lambda: cached_chunk_attention(
            q, k_all[:, :cached], v_all[:, :cached], k_new, v_new, scale),
    }
    cpu = torch.device("cpu")
    for name, kernel in (("vec", vec_prefill), ("amx", amx_prefill)):
        if kernel.fits(dtype, DIM, cpu):
            found[name] = (lambda kernel=kernel: kernel.prefill_attention(
                q, k_new, v_new, k_all[:, :cached], v_all[:, :cached], scale))
    flags = cbuild.cpu_flags()
    if dtype == torch.float32 and "avx512f" in flags and {"avx2", "fma"} <= flags:
        found["vec avx2"] = lambda: vec_prefill.prefill_attention(
            q, k_new, v_new, k_all[:, :cached], v_all[:, :cached], scale, march="x86-64-v3")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--contexts", default="1024,3072,5120")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, chunk {args.chunk}, {args.dtype}")
    header = None
    for cached in (int(c) for c in args.contexts.split(",")):
        runs = ways(args.chunk, cached, dtype)
        if header is None:
            header = list(runs)
            print("| cached tokens | " + " | ".join(header) + " | best / flash split |")
            print("|---" * (len(header) + 2) + "|")
        outs = {name: run() for name, run in runs.items()}  # warm-up, and agreement
        for name, out in outs.items():
            torch.testing.assert_close(out.float(), outs["masked"].float(), rtol=tol, atol=tol,
                                       msg=name)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeats):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - started)
        flops = 4 * HEADS * DIM * args.chunk * (cached + (args.chunk + 1) / 2)
        cells = [f"{t * 1e3:.0f} ms ({flops / t / 1e9:.0f} GFLOP/s)" for t in best.values()]
        print(f"| {cached} | " + " | ".join(cells)
              + f" | {best['flash split'] / min(best.values()):.2f}x |")

if __name__ == "__main__":
    main()
