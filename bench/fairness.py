"""Two tenants on one engine: fair share (VTC) against first come, first served.

On the default SmolLM2 (float32 on CPU), one engine per policy, in one process:

- `light solo`: the light tenant alone, `--light` requests at `--rate` per second (Poisson).
- `mixed`: the same light requests beside a heavy tenant sending 10x as many at 10x the rate,
  equal weights. Reported: the light tenant's TTFT p50/p99 (against its solo figure; the
  target is p99 within 1.5x) and the output throughput of the whole run.
- `backlog`: both tenants queue `--backlog` requests each at once, weights 1:1 and 2:1;
  reported is the heavy-weight tenant's part of the tokens computed while both still had
  requests waiting (target: its weight's share, within 10%).
- `throughput`: everything queued at once, per policy (fair within 3% of FCFS).

Random token prompts of 16-128 tokens, outputs of `--max-tokens`, EOS ignored, seeded.

Usage: .venv/bin/python bench/fairness.py [--light 6] [--rate 0.5] [--backlog 16]
Prints a table and writes bench/results/fairness-cpu.json (non-default runs: -smoke).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from workers import AsyncLLMEngine, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = {"light": 6, "rate": 0.5, "backlog": 16, "max_tokens": 24, "max_num_seqs": 8,
            "shared_step_s": 0.25}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 128))] for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Run:
    """One engine, one policy: send requests, keep each one's TTFT and start."""

    def __init__(self, policy: str, args: argparse.Namespace) -> None:
        self.engine = AsyncLLMEngine(None, device="cpu", dtype="float32",
                                     max_num_seqs=args.max_num_seqs, scheduling_policy=policy,
                                     shared_step_s=args.shared_step_s)
        self.params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        self.ttft: dict[str, list[float]] = {}
        self.started: dict[str, int] = {}
        self.output_tokens = 0

    async def one(self, tenant: str, prompt: list[int], weight: float = 1.0,
                  delay: float = 0.0) -> None:
        await asyncio.sleep(delay)
        sent = time.perf_counter()
        first = True
        async for out in self.engine.generate(prompt, self.params, tenant=tenant,
                                              weight=weight):
            if first and out.token_ids:
                first = False
                self.ttft.setdefault(tenant, []).append(time.perf_counter() - sent)
                self.started[tenant] = self.started.get(tenant, 0) + 1
        self.output_tokens += len(out.token_ids)


def arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def mixed(policy: str, args: argparse.Namespace, with_heavy: bool) -> dict[str, Any]:
    run = Run(policy, args)
    await run.engine.start()
    try:
        await run.one("warm", [1, 2, 3])  # load and first-step costs outside the figures
        rng = random.Random(1)
        tasks = [run.one("light", p, delay=d) for p, d in
                 zip(prompts(args.light, 2), arrivals(args.light, args.rate, rng), strict=True)]
        if with_heavy:
            n = 10 * args.light
            tasks += [run.one("heavy", p, delay=d) for p, d in
                      zip(prompts(n, 3), arrivals(n, 10 * args.rate, rng), strict=True)]
        run.output_tokens = 0
        t0 = time.perf_counter()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    finally:
        await run.engine.shutdown()
    light = run.ttft["light"]
    return {"policy": policy, "heavy": with_heavy, "light_ttft_p50_s": statistics.median(light),
            "light_ttft_p99_s": pct(light, 0.99), "wall_s": wall,
            "output_tok_s": run.output_tokens / wall,
            "heavy_ttft_p50_s": statistics.median(run.ttft["heavy"]) if with_heavy else None}


async def backlog(policy: str, args: argparse.Namespace, weights: tuple[float, float]
                  ) -> dict[str, Any]:
    """Both queue at once; the split of tokens computed while both still have some waiting."""
    run = Run(policy, args)
    await run.engine.start()
    n = args.backlog
    try:
        await run.one("warm", [1, 2, 3])
        start = run.engine.tenant_tokens()
        tasks = [asyncio.create_task(run.one(t, p, weight=w))
                 for i, p in enumerate(prompts(2 * n, 4))
                 for t, w in [(("a", weights[0]), ("b", weights[1]))[i % 2]]]
        end = start
        while all(run.started.get(t, 0) < n for t in ("a", "b")):
            end = run.engine.tenant_tokens()
            await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        await asyncio.gather(*tasks)
        rest = time.perf_counter() - t0
    finally:
        await run.engine.shutdown()
    served = {t: end.get(t, 0) - start.get(t, 0) for t in ("a", "b")}
    total = sum(served.values()) or 1
    return {"policy": policy, "weights": list(weights), "tokens_while_both_wait": served,
            "a_share": served["a"] / total, "a_target": weights[0] / sum(weights),
            "drain_s": rest}


async def throughput(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    run = Run(policy, args)
    await run.engine.start()
    try:
        await run.one("warm", [1, 2, 3])
        run.output_tokens = 0
        t0 = time.perf_counter()
        await asyncio.gather(*[run.one(("a", "b")[i % 3 == 0], p)
                               for i, p in enumerate(prompts(3 * args.backlog, 5))])
        wall = time.perf_counter() - t0
    finally:
        await run.engine.shutdown()
    return {"policy": policy, "wall_s": wall, "output_tok_s": run.output_tokens / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--light", type=int, default=DEFAULTS["light"])
    p.add_argument("--rate", type=float, default=DEFAULTS["rate"])
    p.add_argument("--backlog", type=int, default=DEFAULTS["backlog"])
    p.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"])
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS["max_num_seqs"])
    p.add_argument("--shared-step-s", type=float, default=DEFAULTS["shared_step_s"],
                   help="the engine's step limit while tenants share it (0: off)")
    args = p.parse_args()
    solo = asyncio.run(mixed("fair", args, with_heavy=False))
    rows = [asyncio.run(mixed(policy, args, with_heavy=True)) for policy in ("fcfs", "fair")]
    splits = [asyncio.run(backlog(policy, args, w)) for w in ((1.0, 1.0), (2.0, 1.0))
              for policy in ("fcfs", "fair")]
    totals = [asyncio.run(throughput(policy, args)) for policy in ("fcfs", "fair", "fcfs",
                                                                      "fair")]
    standard = all(getattr(args, k) == v for k, v in DEFAULTS.items())
    out = RESULTS / ("fairness-cpu.json" if standard else "fairness-cpu-smoke.json")
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "machine": cpu_model(),
        "simd": simd_flags(), "python": platform.python_version(),
        "command": " ".join(sys.argv), "solo": solo, "mixed": rows, "backlog": splits,
        "throughput": totals}, indent=2))
    print(f"\n{cpu_model()}; {args.light} light requests at {args.rate}/s, heavy 10x; "
          f"max_num_seqs {args.max_num_seqs}, {args.max_tokens} output tokens each")
    print("| run | light TTFT p50 | light TTFT p99 | p99 / solo p99 | heavy TTFT p50 "
          "| out tok/s |")
    print("|---|---|---|---|---|---|")
    for r in [solo, *rows]:
        name = f"{r['policy']}, with heavy" if r["heavy"] else "light solo"
        heavy = "" if r["heavy_ttft_p50_s"] is None else f"{r['heavy_ttft_p50_s']:.2f} s"
        print(f"| {name} | {r['light_ttft_p50_s']:.2f} s | {r['light_ttft_p99_s']:.2f} s "
              f"| {r['light_ttft_p99_s'] / solo['light_ttft_p99_s']:.1f}x | {heavy} "
              f"| {r['output_tok_s']:.1f} |")
    print("\n| backlog | weights a:b | tokens a / b while both wait | a's share | target |")
    print("|---|---|---|---|---|")
    for r in splits:
        a, b = r["tokens_while_both_wait"]["a"], r["tokens_while_both_wait"]["b"]
        print(f"| {r['policy']} | {r['weights'][0]:g}:{r['weights'][1]:g} | {a} / {b} "
              f"| {r['a_share']:.1%} | {r['a_target']:.1%} |")
    print("\n| throughput, all queued | wall | out tok/s |")
    print("|---|---|---|")
    for r in totals:
        print(f"| {r['policy']} | {r['wall_s']:.1f} s | {r['output_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
