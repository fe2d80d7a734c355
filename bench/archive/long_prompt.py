"""Single-prompt prefill of a long prompt: our engine against one HF transformers forward.

On the default SmolLM2 (float32 on CPU), in one process: the same `--tokens` random token ids
(fixed seed) are prefilled by our engine (`max_tokens=1`, so the time is the prompt's TTFT,
prefix caching off) once per prefill attention kernel in `--kernels`, and by one
`AutoModelForCausalLM` forward with `attn_implementation="sdpa"` on the same folder
(`logits_to_keep=1`, as generate's prefill does). After a short warm-up, the systems run
`--repeats` interleaved rounds (so a shared machine's load hits them alike); each one's best
round is reported. The engine prefills the prompt in chunks of `--chunk` tokens (its step
budget, no per-request cap, so the chunking does not depend on the scheduler's defaults;
512 is the engine's default `long_prefill_token_threshold`), and every chunk after the first
attends to cached context: the case the prefill kernels differ on. The steps are counted.

Usage: .venv/bin/python bench/archive/long_prompt.py [--tokens 6000] [--kernels flash,masked]
Prints a table last and writes bench/results/long_prompt-cpu.json (a non-default run writes
long_prompt-cpu-smoke.json, which git ignores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402
from workers.config import EngineArgs  # noqa: E402
from workers.model_files import resolve_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DEFAULTS = {"tokens": 6000, "kernels": "flash,masked", "repeats": 2,
            "chunk": EngineArgs.model_fields["long_prefill_token_threshold"].default, "hf": True,
            "threads": 0}


def engine_system(kernel: str, llm: LLM, steps: list[int]
                  ) -> tuple[str, Callable[[list[int]], None]]:
    """`steps` gets the number of engine steps of each call."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    runner = llm.engine.runner

    def prefill(ids: list[int]) -> None:
        runner.prefill_attention = kernel
        execute, count = runner.execute, [0]

        def counted(sched: Any, *rest: Any) -> Any:  # rest: the interjection hook
            count[0] += 1
            return execute(sched, *rest)

        runner.execute = counted
        try:
            llm.generate([ids], params)
        finally:
            del runner.execute  # back to the class's method
        steps.append(count[0])

    return f"engine ({kernel})", prefill


def hf_system() -> tuple[str, Callable[[list[int]], None]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(None), dtype=torch.float32, attn_implementation="sdpa").eval()

    def forward(ids: list[int]) -> None:
        with torch.inference_mode():
            model(torch.tensor([ids]), logits_to_keep=1, use_cache=False)

    return "HF transformers (sdpa), one forward", forward


def measure(systems: list[tuple[str, Callable[[list[int]], None]]], prompt: list[int],
            warm: list[int], repeats: int) -> list[dict[str, Any]]:
    """Rounds interleave the systems, so a shared machine's load hits them alike; each
    system's best round is kept, with its process CPU time (both threads) beside the wall."""
    for _, run in systems:
        run(warm)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in systems}
    for _ in range(repeats):
        for name, run in systems:
            wall, cpu = time.perf_counter(), time.process_time()
            run(prompt)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    rows = []
    for name, samples in times.items():
        wall, cpu = min(samples)
        rows.append({"system": name, "prefill_s": wall, "cpu_s": cpu,
                     "all_walls_s": [w for w, _ in samples]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=DEFAULTS["tokens"])
    p.add_argument("--kernels", default=DEFAULTS["kernels"],
                   help="prefill attention kernels to time in turn (flash, masked)")
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    p.add_argument("--chunk", type=int, default=DEFAULTS["chunk"],
                   help="prompt tokens per engine step (its max_num_batched_tokens)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF forward")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default); with 1, process CPU time is "
                        "what the work costs even when the machine is shared")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
    # 1 GiB of KV holds about 22k tokens of SmolLM2 in float32; prefix caching off, so every
    # round prefills the whole prompt
    llm = LLM(None, kv_cache_memory=1 << 30, enable_prefix_caching=False,
              max_num_batched_tokens=args.chunk, long_prefill_token_threshold=0)
    steps: list[int] = []
    systems = [engine_system(k, llm, steps) for k in args.kernels.split(",")]
    if args.hf:
        systems.append(hf_system())
    # the warm-up prompt has a chunk after cached context too
    rows = measure(systems, prompt, prompt[: 2 * args.chunk], args.repeats)
    engine_steps = max(steps)  # the warm-ups took fewer
    standard = all(getattr(args, k) == v for k, v in DEFAULTS.items())
    out = RESULTS / ("long_prompt-cpu.json" if standard else "long_prompt-cpu-smoke.json")
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "machine": cpu_model(),
        "simd_flags": simd_flags(),
        "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "command": " ".join(sys.argv),
        "tokens": args.tokens, "chunk": args.chunk, "engine_steps": engine_steps,
        "attention_backend": llm.engine.runner.attention_backend,
        "linear_backend": llm.engine.runner.linear_backend, "rows": rows,
    }, indent=2))
    hf = next((r["prefill_s"] for r in rows if r["system"].startswith("HF")), None)
    print(f"\n{args.tokens}-token prompt, engine chunks of {args.chunk} tokens "
          f"({engine_steps} steps), {torch.get_num_threads()} threads; {cpu_model()} "
          f"({' '.join(simd_flags())})")
    print("| system | prefill (best) | all rounds | process CPU | prompt tok/s "
          "| time vs HF forward |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['prefill_s'] / hf:.2f}x" if hf else "-"
        rounds = ", ".join(f"{w:.1f}" for w in r["all_walls_s"])
        print(f"| {r['system']} | {r['prefill_s']:.2f} s | {rounds} | {r['cpu_s']:.1f} s "
              f"| {args.tokens / r['prefill_s']:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
