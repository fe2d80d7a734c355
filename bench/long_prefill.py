"""A long prompt beside short ones: the short requests' TTFT and what the cap costs in total.

On the default SmolLM2 (float32 on CPU), in one process, one engine per setting of
`long_prefill_token_threshold` (0 = no cap): a prompt of `--long` random tokens (max_tokens 8)
arrives, then while it is prefilling, `--shorts` requests of 8-24 tokens (max_tokens 8) arrive
one by one. Reported per setting: the short requests' TTFT p50 (and idle: the same short
requests on an empty engine), the long prompt's TTFT, and the wall time of the whole workload
(lower is better; the cap may not cost more than a few percent of it). With `--tenants` the
long prompt and the short requests come from two tenants, so the engine's shared step limit
(`--shared-step-s`, the engine's default unless given) applies, and the short requests may
interject into the long prompt's steps (`--interject-tokens`, likewise).

Usage: .venv/bin/python bench/long_prefill.py [--long 6000] [--caps 0,128,256,512]
Prints a table last and writes bench/results/long_prefill-cpu.json (a non-default run writes
long_prefill-cpu-smoke.json, which git ignores).
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

from bench.common.machine import cpu_model  # noqa: E402
from workers import AsyncLLMEngine, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = {"long": 6000, "shorts": 8, "caps": "0,128,256,512", "budget": 1024}


async def ttft(engine: AsyncLLMEngine, prompt: list[int], request_id: str,
               tenant: str | None = None) -> float:
    started = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = None
    async for _ in engine.generate(prompt, params, request_id=request_id, tenant=tenant):
        if first is None:
            first = time.perf_counter() - started
    assert first is not None
    return first


async def run(cap: int, args: argparse.Namespace, long: list[int],
              shorts: list[list[int]]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if args.shared_step_s is not None:
        extra["shared_step_s"] = args.shared_step_s
    if args.interject_tokens is not None:
        extra["interject_tokens"] = args.interject_tokens
    engine = AsyncLLMEngine(None, max_num_batched_tokens=args.budget,
                            long_prefill_token_threshold=cap, kv_cache_memory=1 << 30, **extra)
    short_tenant, long_tenant = ("short", "long") if args.tenants else (None, None)
    await engine.start()
    try:
        await ttft(engine, shorts[0], "warmup", short_tenant)
        idle = [await ttft(engine, p, f"idle-{i}", short_tenant) for i, p in enumerate(shorts)]
        started = time.perf_counter()
        long_task = asyncio.create_task(ttft(engine, long, "long", long_tenant))
        await asyncio.sleep(0.2)  # the long prompt is prefilling
        busy = await asyncio.gather(*(ttft(engine, prompt, f"short-{i}", short_tenant)
                                      for i, prompt in enumerate(shorts)))
        long_ttft = await long_task
        wall = time.perf_counter() - started
    finally:
        await engine.shutdown()
    return {"cap": cap, "short_ttft_idle_p50_s": statistics.median(idle),
            "short_ttft_busy_p50_s": statistics.median(busy),
            "short_ttft_busy_max_s": max(busy),
            "long_ttft_s": long_ttft, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", type=int, default=DEFAULTS["long"])
    p.add_argument("--shorts", type=int, default=DEFAULTS["shorts"])
    p.add_argument("--caps", default=DEFAULTS["caps"])
    p.add_argument("--budget", type=int, default=DEFAULTS["budget"])
    p.add_argument("--tenants", action="store_true",
                   help="the long prompt and the short requests from two tenants")
    p.add_argument("--shared-step-s", type=float, default=None,
                   help="the engine's step limit while tenants share it (default: the engine's)")
    p.add_argument("--interject-tokens", type=int, default=None,
                   help="the engine's interjection limit (0: off; default: the engine's)")
    args = p.parse_args()
    rng = random.Random(0)
    long = [rng.randrange(100, 40000) for _ in range(args.long)]
    shorts = [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 24))]
              for _ in range(args.shorts)]
    rows = [asyncio.run(run(int(c), args, long, shorts)) for c in args.caps.split(",")]
    base = next((r for r in rows if r["cap"] == 0), rows[0])
    standard = all(getattr(args, k) == v for k, v in DEFAULTS.items()) and not args.tenants
    out = RESULTS / ("long_prefill-cpu.json" if standard else "long_prefill-cpu-smoke.json")
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "machine": cpu_model(),
        "python": platform.python_version(), "command": " ".join(sys.argv), "rows": rows,
    }, indent=2))
    print(f"\nlong prompt {args.long} tokens, step budget {args.budget}, "
          f"{args.shorts} short requests; {cpu_model()}")
    print("| cap | short TTFT idle p50 | short TTFT busy p50 | busy max | busy / idle "
          "| long TTFT | wall | wall vs no cap |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cap'] or 'off'} | {r['short_ttft_idle_p50_s'] * 1000:.0f} ms "
              f"| {r['short_ttft_busy_p50_s'] * 1000:.0f} ms "
              f"| {r['short_ttft_busy_max_s'] * 1000:.0f} ms "
              f"| {r['short_ttft_busy_p50_s'] / r['short_ttft_idle_p50_s']:.1f}x "
              f"| {r['long_ttft_s']:.2f} s | {r['wall_s']:.2f} s "
              f"| {r['wall_s'] / base['wall_s']:.3f} |")


if __name__ == "__main__":
    main()
