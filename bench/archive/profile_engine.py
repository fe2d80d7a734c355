"""Where an engine step's time goes, and how close the run comes to the machine's GEMM roofline.

Run from the repository root:

    .venv/bin/python bench/archive/profile_engine.py                       # the standard workload
    .venv/bin/python bench/archive/profile_engine.py --num-requests 16     # quick look
    .venv/bin/python bench/archive/profile_engine.py --engine-arg elementwise=torch

The engine runs `llm.generate` over the workload once with every part of a step wrapped in a
wall-clock timer (CPU work is synchronous, so a timer around a call is its cost): scheduling,
input preparation, each kind of projection, attention, KV writes, RoPE, the residual add with
RMSNorm, SiLU-and-multiply (with `elementwise=torch` it is in "model: rest"), the rest of the
model (embedding, views), logits, sampling, and the engine's bookkeeping. The
wrappers are installed here only; the engine is not changed.

The roofline: the machine's float GEMM GFLOP/s is measured in the same run (the engine's own
linear kernel, a 2,048 x 576 x 1,536 product, best of several), and the run's useful FLOPs are
2 x parameters x tokens processed (prompt tokens included; the LM head counts only for the rows
that are sampled) plus attention (4 x context x head size x query heads per token and layer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from bench.common.workload import STANDARD, WORKLOADS, build_workload  # noqa: E402


class Timers:
    """Seconds and calls per part (parts nest: "model" holds the projections' time)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time every call of `owner.attr` (a function or method) as part `name`."""
        inner: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.part(name):
                return inner(*args, **kwargs)

        setattr(owner, attr, timed)


def instrument(llm: Any, timers: Timers) -> None:
    """Wrap the engine's parts in timers: module functions where the model imports them, the
    projections per kind, the runner's and the engine's own stages."""
    import workers.runner.attention as attention_mod
    import workers.runner.cpu_decode as cpu_decode_mod
    import workers.runner.model as model_mod
    import workers.runner.model_runner as runner_mod
    from workers.runner import amx_prefill, cpu_fused

    engine = llm.engine
    runner = engine.runner
    model = runner.model
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine, "_update", "update")
    timers.wrap(runner, "_prepare", "prepare")
    timers.wrap(model, "forward", "model")
    timers.wrap(model, "compute_logits", "logits")
    timers.wrap(runner_mod, "sample", "sample")
    timers.wrap(model_mod, "paged_attention", "attention")
    timers.wrap(model_mod, "write_kv", "write_kv")
    timers.wrap(model_mod, "apply_rotary", "rope")
    timers.wrap(cpu_fused, "rope_", "rope")
    timers.wrap(cpu_fused, "store_kv", "write_kv")
    timers.wrap(cpu_fused, "silu_mul", "silu_mul")
    # Inside attention: the decode kernel (looked up at each call), prefill without and with
    # cached context (the latter includes gathering that context out of the pool).
    timers.wrap(cpu_decode_mod, "paged_decode", "  decode kernel")
    timers.wrap(attention_mod, "_decode", "  decode torch")
    timers.wrap(attention_mod, "_prefill_fresh", "  prefill fresh")
    timers.wrap(attention_mod, "cached_chunk_attention", "  prefill cached")
    timers.wrap(attention_mod, "_prefill_cached", "  prefill masked")
    timers.wrap(amx_prefill, "prefill_attention", "  prefill amx")  # fresh and cached
    timers.wrap(attention_mod.GatherWorkspace, "gather", "  gather")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj, name in ((attn.qkv_proj, "gemm qkv"), (attn.o_proj, "gemm o"),
                           (mlp.gate_up_proj, "gemm gate_up"), (mlp.down_proj, "gemm down")):
            timers.wrap(proj, "forward", name)
        timers.wrap(layer.input_layernorm, "add_norm", "add+rmsnorm")
        timers.wrap(layer.post_attention_layernorm, "add_norm", "add+rmsnorm")
    timers.wrap(model.norm, "add_norm", "add+rmsnorm")


def gemm_gflops(kernel: Callable[..., Any], dtype: Any, repeats: int = 7,
                weight_dtype: Any = None) -> float:
    """The machine's float GEMM rate through the engine's linear kernel (best of `repeats`);
    `weight_dtype` where the kernel's weights differ from the activations (`onednn_upcast`)."""
    import torch

    x = torch.randn(2048, 576, dtype=dtype)
    w = torch.randn(1536, 576, dtype=weight_dtype or dtype)
    kernel(x, w, None)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernel(x, w, None)
        best = min(best, time.perf_counter() - start)
    return 2 * 2048 * 576 * 1536 / best / 1e9


def run_arrivals(llm: Any, wl: Any, params: list[Any]) -> list[Any]:
    """Add each request at its arrival offset (between steps, as an async server would) and
    step until all are done; outputs in workload order."""
    engine = llm.engine
    pending = list(enumerate(wl.requests))
    finished: dict[int, Any] = {}
    start = time.perf_counter()
    while len(finished) < len(wl.requests):
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival_offset <= now:
            i, request = pending.pop(0)
            engine.add_request(f"r{i}", request.prompt_token_ids, params[i])
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][1].arrival_offset - now))
            continue
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id[1:])] = output
    return [finished[i] for i in range(len(wl.requests))]


def median(values: list[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return present[len(present) // 2] if present else None


def useful_flops(model: Any, outs: list[Any], prompts: list[list[int]]) -> dict[str, float]:
    """2 x parameters x tokens (LM head only for sampled rows) plus attention, for the run."""
    cfg = model.config
    layer_params = sum(p.numel() for name, p in model.named_parameters()
                       if name.startswith("layers.") and "layernorm" not in name)
    head_params = cfg.vocab_size * cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tokens = sampled = 0
    attention = 0.0
    for out, prompt in zip(outs, prompts, strict=True):
        total = len(prompt) + len(out.token_ids)
        # Every token but the last is run through the model once; each is sampled after
        # the prompt's last one. Attention: token at position p reads p + 1 keys.
        run = total - 1
        tokens += run
        sampled += len(out.token_ids)
        attention += 4.0 * head_dim * cfg.num_attention_heads * cfg.num_hidden_layers * (
            run * (run + 1) / 2)
    return {"tokens": tokens, "sampled": sampled,
            "projections": 2.0 * layer_params * tokens, "head": 2.0 * head_params * sampled,
            "attention": attention}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="standard",
                   help="engine_throughput.py's workloads; the flags below override it")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--max-prompt", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--seed", type=int, default=STANDARD["seed"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    p.add_argument("--engine-arg", action="append", metavar="KEY=VALUE", default=[])
    p.add_argument("--rate", type=float, default=0.0,
                   help="Poisson arrivals at this many req/s, driven step by step as "
                        "engine_throughput.py's online mode sends them (0: all at once)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    preset = WORKLOADS[args.workload]
    for key in ("num_requests", "max_prompt", "max_output"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])

    import os

    import torch
    from transformers import AutoTokenizer

    from workers import LLM, SamplingParams
    from workers.model_files import resolve_model

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    for item in args.engine_arg:
        key, _, raw = item.partition("=")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    wl = build_workload(tokenizer, args.num_requests, args.max_prompt, args.max_output,
                        # a positive rate draws arrival gaps from the same seeded stream as
                        # the lengths, so --rate 0 must still draw them: the same token ids
                        # as engine_throughput.py's workload at any rate
                        args.seed, rate=args.rate or 2.0, min_prompt=preset["min_prompt"],
                        min_output=preset["min_output"])
    llm = LLM(**kwargs)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([wl.requests[0].prompt_token_ids], warm)
    model = llm.engine.runner.model
    gflops = gemm_gflops(model.linear_kernel, model.embed_tokens.weight.dtype,
                         weight_dtype=model.layers[0].mlp.down_proj.weight.dtype)

    timers = Timers()
    instrument(llm, timers)
    prompts = [r.prompt_token_ids for r in wl.requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in wl.requests]
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = run_arrivals(llm, wl, params) if args.rate > 0 else llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    report = breakdown(timers, wall)
    flops = useful_flops(model, outs, prompts)
    useful = flops["projections"] + flops["head"] + flops["attention"]
    result = {
        "cpu": cpu_model(), "flags": simd_flags(), "threads": torch.get_num_threads(),
        "engine_args": kwargs, "requests": len(prompts), "wall_s": wall,
        "process_cpu_s": cpu, "output_tok_s": flops["sampled"] / wall,
        "gemm_gflops": gflops, "achieved_gflops": useful / wall / 1e9,
        "roofline_share": useful / wall / 1e9 / gflops, "flops": flops, "parts": report,
        "rate": args.rate, "ttft_p50_s": median([o.metrics.ttft for o in outs]),
        "tpot_p50_s": median([o.metrics.tpot for o in outs]),
    }
    print_report(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


MODEL_PARTS = ("gemm qkv", "gemm o", "gemm gate_up", "gemm down", "attention", "write_kv",
               "rope", "add+rmsnorm", "silu_mul")
ATTENTION_PARTS = ("  decode kernel", "  decode torch", "  prefill fresh", "  prefill cached",
                   "  prefill masked", "  prefill amx", "  gather")
STEP_PARTS = ("schedule", "prepare", "model", "logits", "sample", "update")


def breakdown(timers: Timers, wall: float) -> list[dict[str, Any]]:
    """Rows of (part, seconds, share of wall); "model: rest" and "host: rest" are what the
    named parts inside the model and around it leave over."""
    s = timers.seconds
    rows = [(name, s.get(name, 0.0), timers.calls.get(name, 0)) for name in MODEL_PARTS]
    rows.append(("model: rest", s.get("model", 0.0) - sum(r[1] for r in rows), 0))
    at = rows.index(next(r for r in rows if r[0] == "attention")) + 1
    rows[at:at] = [(name, s[name], timers.calls[name]) for name in ATTENTION_PARTS
                   if name in s]
    rows += [(name, s.get(name, 0.0), timers.calls.get(name, 0))
             for name in STEP_PARTS if name != "model"]
    # with --rate, waiting for the next arrival while idle counts here
    rows.append(("host: rest", wall - sum(s.get(n, 0.0) for n in STEP_PARTS), 0))
    return [{"part": n, "seconds": sec, "share": sec / wall, "calls": c} for n, sec, c in rows]


def print_report(r: dict[str, Any]) -> None:
    print(f"profile_engine  {r['cpu']} ({' '.join(r['flags'])})  threads {r['threads']}  "
          f"{r['requests']} requests  engine args {r['engine_args']}")
    print(f"wall {r['wall_s']:.1f} s, process CPU {r['process_cpu_s']:.1f} s, "
          f"{r['output_tok_s']:.1f} output tok/s, TTFT p50 {1e3 * (r['ttft_p50_s'] or 0):.0f} "
          f"ms, TPOT p50 {1e3 * (r['tpot_p50_s'] or 0):.1f} ms"
          + (f" (arrivals {r['rate']} req/s)" if r["rate"] else " (all at once)"))
    f = r["flops"]
    print(f"tokens run {f['tokens']:,}, sampled {f['sampled']:,}; useful GFLOP: projections "
          f"{f['projections'] / 1e9:,.0f}, head {f['head'] / 1e9:,.0f}, attention "
          f"{f['attention'] / 1e9:,.0f}")
    print(f"GEMM roofline {r['gemm_gflops']:.1f} GFLOP/s; achieved {r['achieved_gflops']:.1f} "
          f"GFLOP/s = {100 * r['roofline_share']:.1f}% of it")
    print(f"{'part':>14} {'seconds':>9} {'share':>7} {'calls':>8}")
    for row in r["parts"]:
        print(f"{row['part']:>14} {row['seconds']:>9.2f} {100 * row['share']:>6.1f}% "
              f"{row['calls']:>8}")


if __name__ == "__main__":
    raise SystemExit(main())
