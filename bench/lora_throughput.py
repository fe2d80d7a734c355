"""Multi-LoRA throughput: 64 requests over 16 adapters vs the base model vs naive peft.

On the default SmolLM2 (float32 on CPU, bfloat16 on CUDA), one workload: 64 requests of
32-128 random prompt tokens, 64 output tokens each (greedy, EOS ignored), all arriving at
once. 16 peft adapters with random non-zero weights on all seven projections, ranks 8 and 16
alternating; request i uses adapter i % 16. Systems, each in this process, one after another:

- base: our engine, LoRA off, every request on the base model;
- lora: our engine with `max_loras=16`, each request with its adapter, all in mixed batches;
- lora-4: the same with only `max_loras=4` slots (the scheduler caps distinct adapters per
  step, so requests queue for slots and adapters are swapped in and out);
- peft: naive multi-adapter serving: one peft PeftModel holding all 16 adapters, and for each
  adapter `set_adapter` + HF `generate()` of its 4 requests as one left-padded batch.

Throughput = output tokens / wall time. `agree` = share of requests whose first 16 tokens equal
peft's (a bug alarm; float rounding may flip a near tie).

Usage: .venv/bin/python bench/lora_throughput.py [--device cuda] [--skip-peft]
Prints a table last and writes bench/results/lora_throughput-<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common.machine import cpu_model  # noqa: E402
from workers import LLMEngine, SamplingParams  # noqa: E402
from workers.model_files import resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, folder: Path, count: int) -> list[Path]:
    """Real peft adapters, random non-zero weights, ranks 8 and 16 alternating."""
    import peft
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base)
        rank = 8 if i % 2 == 0 else 16
        config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=MODULES,
                                 init_lora_weights=False)
        path = folder / f"adapter-{i:02d}"
        peft.get_peft_model(model, config).save_pretrained(path)
        paths.append(path)
    return paths


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(rng.randint(32, 128))] for _ in range(n)]


def run_engine(prompts: list[list[int]], loras: list[str | None], max_tokens: int,
               engine_args: dict[str, Any], adapters: dict[str, Path]) -> dict[str, Any]:
    engine = LLMEngine.from_args(model=None, **engine_args)
    for name, path in adapters.items():
        engine.add_lora(name, str(path))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # warm-up: one request per distinct adapter, so lazy kernels and slot copies are not timed
    for i, name in enumerate(dict.fromkeys(loras)):
        engine.add_request(f"warm{i}", prompts[0][:16], SamplingParams(max_tokens=2), lora=name)
    while engine.has_unfinished_requests():
        engine.step()
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{i}", prompt, params, lora=name)
    tokens: dict[int, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id[1:])] = out.token_ids
    elapsed = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    return {"output_tokens_per_s": generated / elapsed, "elapsed_s": elapsed,
            "output_tokens": generated, "steps": steps, "stats": engine.stats(),
            "tokens": [tokens[i] for i in range(len(prompts))]}


@torch.inference_mode()
def run_peft(base: Path, adapters: dict[str, Path], prompts: list[list[int]],
             loras: list[str], max_tokens: int, device: str, dtype: torch.dtype,
             ) -> dict[str, Any]:
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device)
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(loras):
        groups.setdefault(name, []).append(i)
    tokens: dict[int, list[int]] = {}
    start = time.perf_counter()
    for name, members in groups.items():
        model.set_adapter(name)
        width = max(len(prompts[i]) for i in members)
        ids = torch.zeros(len(members), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(members):  # left padding, as HF generate expects
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
        for row, i in enumerate(members):
            tokens[i] = out[row, width:].tolist()
    elapsed = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    return {"output_tokens_per_s": generated / elapsed, "elapsed_s": elapsed,
            "output_tokens": generated, "tokens": [tokens[i] for i in range(len(prompts))]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-peft", action="store_true")
    args = parser.parse_args()

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = resolve_model(None)
    common = dict(device=device, max_num_seqs=64, max_num_batched_tokens=2048,
                  kv_cache_memory=1 << 30 if device == "cpu" else None)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        paths = make_adapters(base, Path(tmp), args.adapters)
        adapters = {f"a{i:02d}": p for i, p in enumerate(paths)}
        names = list(adapters)
        probe = LLMEngine.from_args(model=None, device=device, kv_cache_memory=1 << 26)
        prompts = workload(args.requests, probe.vocab_size)
        del probe
        loras = [names[i % len(names)] for i in range(args.requests)]
        results: dict[str, Any] = {}
        results["base"] = run_engine(prompts, [None] * len(prompts), args.max_tokens,
                                     common, {})
        lora_args = dict(enable_lora=True, max_lora_rank=16)
        results["lora"] = run_engine(prompts, loras, args.max_tokens,
                                     {**common, **lora_args, "max_loras": len(names)}, adapters)
        results["lora-4"] = run_engine(prompts, loras, args.max_tokens,
                                       {**common, **lora_args, "max_loras": 4}, adapters)
        if not args.skip_peft:
            results["peft"] = run_peft(base, adapters, prompts, loras, args.max_tokens,
                                       device, dtype)

    peft_tokens = results.get("peft", {}).get("tokens")
    for r in results.values():
        tokens = r.pop("tokens")
        if peft_tokens is not None:
            same = sum(a[:16] == b[:16] for a, b in zip(tokens, peft_tokens, strict=True))
            r["agree_with_peft"] = same / len(tokens)
    base_tps = results["base"]["output_tokens_per_s"]
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "processor": cpu_model(),
                    "gpu": torch.cuda.get_device_name() if device == "cuda" else None},
        "command": "bench/lora_throughput.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v not in (None, False)),
        "results": results,
        "lora_vs_base": results["lora"]["output_tokens_per_s"] / base_tps,
        "lora_vs_peft": (results["lora"]["output_tokens_per_s"]
                         / results["peft"]["output_tokens_per_s"]) if "peft" in results else None,
    }
    RESULTS.mkdir(exist_ok=True)
    standard = (args.requests, args.adapters, args.max_tokens) == (64, 16, 64)
    suffix = "" if standard else "-smoke"
    (RESULTS / f"lora_throughput-{device}{suffix}.json").write_text(
        json.dumps(record, indent=2) + "\n")

    print(f"{'system':8} {'out tok/s':>10} {'vs base':>8} {'wall s':>8} {'agree':>6}")
    for name, r in results.items():
        agree = r.get("agree_with_peft")
        print(f"{name:8} {r['output_tokens_per_s']:10.1f} "
              f"{r['output_tokens_per_s'] / base_tps:8.2f} {r['elapsed_s']:8.1f} "
              f"{'' if agree is None else f'{100 * agree:5.0f}%':>6}")
    print(f"lora / base: {record['lora_vs_base']:.2f} (target >= 0.70)")
    if record["lora_vs_peft"] is not None:
        print(f"lora / naive peft: {record['lora_vs_peft']:.1f}x (target >= 5x)")


if __name__ == "__main__":
    main()
