"""Speculative decoding (prompt lookup) against plain decoding, in one engine and one process.

Run from the repository root:

    .venv/bin/python bench/speculative.py                      # SmolLM2, the figures in docs
    .venv/bin/python bench/speculative.py --rounds 1 --standard-requests 16   # quick look

Two workloads, greedy:
- "repeating": SmolLM2 asked to copy-edit a paragraph and give it back in full, the case
  prompt lookup targets (its output quotes its prompt). TPOT p50 at batch 1 and 8.
- "standard": the engine benchmark's standard workload (bench/common/workload.py, 64 requests),
  output tok/s, where proposals rarely match and, at 64 rows, are off (max_batch).

Both arms run on the same engine: the plain arm sends `speculative_tokens=0`, so weights,
caches and threads are shared and only proposals differ. Arms alternate, `--rounds` times
each, and the medians are reported. Greedy tokens of the two arms are compared.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from bench.common.workload import _template_ids, build_workload  # noqa: E402

# Written for this benchmark: plain prose with a few slips for the model to mend.
PARAGRAPHS = [
    "The old lighthouse stood at the end of the harbour wall. Every evening the keeper climbed "
    "the narrow stairs, trimmed the wick and wound the clock that turned the lens. Ships that "
    "passed in the night saw its beam sweep across the water once every ten seconds, and they "
    "knew where the rocks were. When the light was finaly automated, the keeper moved to a "
    "cottage in the village, but he still walked to the wall each evening to watch it turn.",
    "Bread needs only flour, water, salt and yeast, yet no two loaves are quite the same. The "
    "flour decides how much water the dough can take, the warmth of the kitchen decides how "
    "fast it rises, and the baker's hands decide how much air it keeps. A slow rise in a cool "
    "room gives a deeper flavour than a quick one in a warm room, which is why many bakers "
    "leave their dough overnight and bake it early the next morning.",
    "The river rises in the hills to the north and reaches the sea after two hundred miles. In "
    "its upper course it runs fast over stones, and trout hide in the pools below the falls. "
    "Lower down it slows, widens and winds through farmland, where herons stand in the "
    "shallows. At the coast it meets the tide in a broad estuary of mud flats and salt marsh, "
    "home in winter to thousands of geese that arrive from the far north.",
    "A good map leaves out far more than it shows. The mapmaker chooses which roads to draw, "
    "which towns to name and which hills to shade, and every choice depends on what the map is "
    "for. A walker needs footpaths, gates and the steepness of the ground; a driver needs "
    "junctions and the numbers of the roads. The same valley can look like two different "
    "places on two maps, and both of them can be correct.",
]
INSTRUCTION = ("Correct any spelling mistakes in the following paragraph and write the whole "
               "paragraph out again, unchanged otherwise:\n\n")


def repeating_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    return [_template_ids(tokenizer, INSTRUCTION + PARAGRAPHS[i % len(PARAGRAPHS)])
            for i in range(count)]


def truncated_draft(layers: int, out: Path) -> Path:
    """The default model cut to its first `layers` layers (final norm and head kept): a draft
    of the same vocabulary when no smaller sibling is at hand (self-speculation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.model_files import resolve_model

    folder = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


def run_arm(llm: Any, sp_cls: Any, prompts: list[list[int]], max_tokens: list[int],
            speculative: bool, ignore_eos: bool) -> dict[str, Any]:
    params = [sp_cls(temperature=0.0, max_tokens=m, ignore_eos=ignore_eos,
                     speculative_tokens=None if speculative else 0) for m in max_tokens]
    before = llm.engine.spec_stats.figures()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = llm.engine.spec_stats.figures()
    tokens = sum(len(o.token_ids) for o in outs)
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_s": tokens / wall,
        "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else None,
        "acceptance": accepted / proposed if proposed else None,
        "proposed": proposed,
        "ids": [list(o.token_ids) for o in outs],
    }


def compare(llm: Any, sp_cls: Any, prompts: list[list[int]], max_tokens: list[int],
            rounds: int, ignore_eos: bool) -> dict[str, Any]:
    arms: dict[str, list[dict[str, Any]]] = {"plain": [], "spec": []}
    for _ in range(rounds):
        for name in arms:
            arms[name].append(run_arm(llm, sp_cls, prompts, max_tokens, name == "spec",
                                      ignore_eos))
    report: dict[str, Any] = {"requests": len(prompts)}
    for name, runs in arms.items():
        report[name] = {
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "tpot_p50_ms": statistics.median(r["tpot_p50_ms"] for r in runs
                                             if r["tpot_p50_ms"] is not None),
            "acceptance": runs[0]["acceptance"],
            "proposed": runs[0]["proposed"],
            "output_tokens": runs[0]["output_tokens"],
            "runs_tok_s": [round(r["tok_s"], 2) for r in runs],
        }
    report["identical_greedy"] = all(
        p["ids"] == s["ids"] for p, s in zip(arms["plain"], arms["spec"], strict=True))
    report["tpot_speedup"] = report["plain"]["tpot_p50_ms"] / report["spec"]["tpot_p50_ms"]
    report["tok_s_ratio"] = report["spec"]["tok_s"] / report["plain"]["tok_s"]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, default=4, help="proposals per step (k)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--repeat-max-tokens", type=int, default=160)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--standard-requests", type=int, default=64)
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--draft-layers", type=int, default=8,
                        help="method draft: the default model's first N layers as the draft")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="extra engine keyword, key=json (e.g. quantization=\"int8\")")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/speculative-cpu.json")
    args = parser.parse_args(argv)

    import torch

    from workers import LLM, SamplingParams

    extra = {k: json.loads(v) for k, _, v in (a.partition("=") for a in args.engine_arg)}
    speculative = {"method": args.method, "num_tokens": args.num_tokens,
                   "max_batch": args.max_batch}
    if args.method == "draft":
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="draft-"))
        speculative["draft_model"] = str(truncated_draft(args.draft_layers, folder))
    llm = LLM(device="cpu", dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=64,
              speculative=speculative, **extra)
    tokenizer = llm.engine.tokenizer
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm up
    report: dict[str, Any] = {
        "machine": {"cpu": cpu_model(), "simd": simd_flags(), "threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "settings": vars(args) | {"out": str(args.out)},
        "repeating": {},
    }
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = repeating_prompts(tokenizer, batch)
        result = compare(llm, SamplingParams, prompts, [args.repeat_max_tokens] * batch,
                         args.rounds, ignore_eos=False)
        report["repeating"][str(batch)] = result
        print(f"repeating batch {batch}: TPOT p50 plain {result['plain']['tpot_p50_ms']:.1f} ms"
              f" {args.method} {result['spec']['tpot_p50_ms']:.1f} ms"
              f" ({result['tpot_speedup']:.2f}x),"
              f" acceptance {result['spec']['acceptance']}, identical "
              f"{result['identical_greedy']}", flush=True)
    if args.standard_requests:
        wl = build_workload(tokenizer, args.standard_requests, 512, 256, 0, 0.0)
        result = compare(llm, SamplingParams, [r.prompt_token_ids for r in wl.requests],
                         [r.max_tokens for r in wl.requests], args.rounds, ignore_eos=True)
        report["standard"] = result
        print(f"standard {args.standard_requests}: tok/s plain {result['plain']['tok_s']:.1f} "
              f"{args.method} {result['spec']['tok_s']:.1f} ({result['tok_s_ratio']:.3f}x), "
              f"identical {result['identical_greedy']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
