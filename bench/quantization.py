"""Weight-only int8 GEMMs on CPU: which kernel serves `quantization: int8` (docs/benchmarks.md).

Times, on SmolLM2-135M's projection shapes at 1/8/64/256 rows, each int8 candidate against
the float32 oneDNN matmul the engine uses without quantization:

- `tiled`: the engine's kernel (`workers/runner/quantization.py`): the int8 weight cast tile
  by tile into cache-sized float tiles, each through oneDNN, output columns scaled after;
- `whole`: the whole weight cast per call, then oneDNN (dequantize-on-the-fly, no tiling);
- `pack`: PyTorch's fused `torch._weight_int8pack_mm` (skipped past --pack-rows: it walks the
  weight once per row and takes seconds there).

Each candidate runs interleaved with the float side (bench/common/timing.py), so a shared machine's
drift hits both. Weights are cold per call only as far as the shapes exceed the caches: the
LM head's (113 MB float32) does, the layers' (1-7 MB) stay in L3, which favours float here;
the engine figures (bench/engine_throughput.py) are the ones that decide.

With `--model`, instead: the bundled SmolLM2's weight bytes (float32 against int8), KV tokens
per GiB for each kv_cache_dtype, and held-out perplexity (tests/data/heldout.txt) for float32,
int8 weights, int8 KV and both.

With `--agree FLOAT.json OTHER.json ...` (results of `bench/engine_throughput.py
--keep-outputs`), instead: greedy agreement of each run with the first, token by token.

Usage: .venv/bin/python bench/quantization.py [--rows 1,8,64,256] [--rounds 5] [--threads 1]
       .venv/bin/python bench/quantization.py --model
       .venv/bin/python bench/quantization.py --agree float.json int8.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common.machine import cpu_model  # noqa: E402
from bench.common.timing import interleaved  # noqa: E402
from bench.common.workload import LINEAR_SHAPES as SHAPES  # noqa: E402
from workers.runner.linear import onednn_linear  # noqa: E402
from workers.runner.quantization import int8_linear, quantize_per_channel  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def candidates(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, pack: bool) -> dict:
    out = {
        "tiled": lambda: int8_linear(x, q, scale, None, onednn_linear),
        "whole": lambda: onednn_linear(x, q.to(x.dtype)).mul_(scale),
    }
    if pack:
        out["pack"] = lambda: torch._weight_int8pack_mm(x, q, scale)
    return out


def compare(rows: int, in_features: int, out_features: int, rounds: int,
            pack_rows: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g) * in_features**-0.5
    q, scale = quantize_per_channel(weight)
    dense = lambda: onednn_linear(x, weight)  # noqa: E731
    calls = 3 if rows * out_features > 1 << 22 else 10
    result: dict[str, float] = {}
    for name, fn in candidates(x, q, scale, rows <= pack_rows).items():
        float_ms, int8_ms = interleaved(dense, fn, rounds, calls)
        result.setdefault("float_us", float_ms * 1e3)
        result[f"{name}_us"] = int8_ms * 1e3
        result[f"{name}_err"] = float((fn() - dense()).abs().max())
    return result


def model_figures() -> dict:
    """Weight bytes, KV tokens per GiB and held-out perplexity of SmolLM2 per setting."""
    from workers import LLM
    from workers.runner.kv_cache import KVCacheSpec
    from workers.runner.perplexity import perplexity
    from workers.runner.quantization import weight_bytes

    text = (ROOT / "tests" / "data" / "heldout.txt").read_text()
    figures: dict = {"settings": []}
    for settings in ({}, {"dtype": "bfloat16"}, {"quantization": "int8"},
                     {"quantization": "int8", "int8_compute": "model"},
                     {"kv_cache_dtype": "int8"},
                     {"quantization": "int8", "kv_cache_dtype": "int8"}):
        llm = LLM(None, kv_cache_memory=64 << 20, **settings)
        runner = llm.engine.runner
        config = runner.model.config
        spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads,
                           runner.model.layers[0].self_attn.head_dim, runner.block_size,
                           runner.dtype, settings.get("kv_cache_dtype", "auto"))
        row = {"settings": settings, "weight_bytes": weight_bytes(runner.model),
               "kv_tokens_per_gib": (1 << 30) // spec.bytes_per_block * spec.block_size,
               "perplexity": perplexity(runner, llm.tokenizer.encode(text))}
        figures["settings"].append(row)
        print(f"{settings!s:50} weights {row['weight_bytes'] / 2**20:7.1f} MiB  KV tokens/GiB "
              f"{row['kv_tokens_per_gib']:7d}  perplexity {row['perplexity']:.4f}", flush=True)
    return figures


SETTINGS = {"float32": {}, "bfloat16": {"dtype": "bfloat16"},
            "int8 weights": {"quantization": "int8"},
            "int8 w, f32 mm": {"quantization": "int8", "int8_compute": "model"},
            "int8 KV": {"kv_cache_dtype": "int8"},
            "both": {"quantization": "int8", "kv_cache_dtype": "int8"}}


def decode_steps(rows: int, context: int, steps: int,
                 model: str | None = None) -> dict[str, float]:
    """Median seconds of one decode step (`rows` sequences at `context` tokens, logits
    included) per setting, the settings' steps interleaved so that a busy machine's drift
    hits all alike. The pool's contents do not change the work, so it is left as allocated."""
    import statistics
    import time

    from workers import LLM
    from workers.runner.attention import build_metadata

    runners = {}
    blocks = -(-(context + 1) // 16)
    for name, settings in SETTINGS.items():
        memory = rows * blocks * 16 * (12_240 if "kv_cache_dtype" in settings else 46_080)
        runners[name] = LLM(model, kv_cache_memory=memory + (8 << 20), **settings).engine.runner
    times: dict[str, list[float]] = {name: [] for name in runners}
    ids = torch.randint(3, 40_000, (rows,))
    positions = torch.full((rows,), context)
    for _ in range(steps + 1):  # the first round warms up
        for name, runner in runners.items():
            config = runner.model.config
            seqs = [(context, 1, list(range(r * blocks, (r + 1) * blocks))) for r in range(rows)]
            start = time.perf_counter()
            with torch.inference_mode():
                meta = build_metadata(
                    seqs, runner.block_size, config.num_key_value_heads,
                    config.num_attention_heads // config.num_key_value_heads, runner.device,
                    runner.dtype, decode_kernel=None if runner.attention_backend == "torch"
                    else runner.attention_backend, workspace=runner.workspace)
                hidden = runner.model(ids, positions, runner.kv_caches, meta, runner.block_size)
                runner.model.compute_logits(hidden)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name:14} step {median * 1e3:7.1f} ms  {rows / median:6.1f} tok/s  "
              f"{medians['float32'] / median:4.2f}x float32", flush=True)
    return medians


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Token-level agreement (same id at the same position of the same request), requests
    wholly identical, and the median position of a request's first differing token."""
    pairs = list(zip(base, other, strict=True))  # same workload: same lengths (ignore_eos)
    same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    firsts = sorted(next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b),
                         len(x)) for x, y in pairs)
    return {"token_agreement": same / sum(map(len, base)),
            "identical_requests": sum(x == y for x, y in pairs),
            "requests": len(base), "first_difference_median": firsts[len(firsts) // 2]}


def compare_runs(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text())["results"][0] for p in paths]
    base = runs[0]
    for path, run in zip(paths, runs, strict=True):
        a = agreement(base["outputs"], run["outputs"])
        print(f"{path}: {run['output_tok_s']:.1f} tok/s (TPOT p50 {run['tpot_p50'] * 1e3:.0f} "
              f"ms), tokens agreeing {a['token_agreement']:.3f}, identical requests "
              f"{a['identical_requests']}/{a['requests']}, first difference at token "
              f"{a['first_difference_median']} (median)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pack-rows", type=int, default=8,
                        help="run _weight_int8pack_mm up to this many rows")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default); 1 sidesteps the OpenMP "
                             "barrier stalls a busy 2-core machine adds to every call")
    parser.add_argument("--model", action="store_true",
                        help="SmolLM2's weight bytes, KV tokens per GiB and perplexities")
    parser.add_argument("--agree", nargs="+", metavar="RESULTS_JSON",
                        help="greedy agreement of engine_throughput runs with the first")
    parser.add_argument("--step", metavar="ROWSxCONTEXT",
                        help="instead: one decode step of ROWS sequences at CONTEXT tokens "
                             "per setting, interleaved (e.g. 64x384)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--model-path", default=None,
                        help="--step on this model folder instead of the bundled SmolLM2 "
                             "(e.g. random weights of its shape: the work does not depend on them)")
    args = parser.parse_args()
    if args.step:
        rows, context = (int(v) for v in args.step.split("x"))
        decode_steps(rows, context, args.steps, args.model_path)
        return 0
    if args.agree:
        compare_runs(args.agree)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / "quantization-model-cpu.json"
        out.write_text(json.dumps({"cpu": cpu_model(), **model_figures()}, indent=2))
        print(f"wrote {out}")
        return 0
    rows_list = [int(r) for r in args.rows.split(",")]
    wanted = args.shapes.split(",")
    table = []
    for name, k, n in SHAPES:
        if name not in wanted:
            continue
        for rows in rows_list:
            r = compare(rows, k, n, args.rounds, args.pack_rows)
            table.append({"shape": name, "in": k, "out": n, "rows": rows, **r})
            cells = "  ".join(f"{c[:-3]} {r[c]:9.0f}us ({r['float_us'] / r[c]:4.2f}x)"
                              for c in r if c.endswith("_us") and c != "float_us")
            print(f"{name:8} {rows:4}  float {r['float_us']:9.0f}us  {cells}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out = RESULTS / "quantization-cpu.json"
    out.write_text(json.dumps({"cpu": cpu_model(), "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "time": stamp,
                               "rows": table}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
