"""Our engine as a system of bench/engine_throughput.py: offline (one `LLM.generate` over every
request) and online (`AsyncLLMEngine` with the workload's Poisson arrivals), and on CUDA the
decode step's share of the measured copy bandwidth. Runs in the child for `--only engine`."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.common.model_folders import kv_bytes_per_token, weight_bytes_read_per_step
from bench.common.throughput_stats import (
    HEAD_TOKENS,
    RequestStat,
    percentile,
    summarize,
    sync,
)
from bench.common.workload import Request, Workload


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine args shared with HF continuous batching, so both get the same limits."""
    kw: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_batched_tokens,
        "kv_cache_memory": args.kv_cache_bytes,
    }
    if args.block_size:
        kw["block_size"] = args.block_size
    for item in args.engine_arg or []:
        key, _, raw = item.partition("=")
        try:
            kw[key] = json.loads(raw)
        except json.JSONDecodeError:
            kw[key] = raw
    return kw


def engine_model_arg(args: argparse.Namespace) -> str | None:
    """None selects the engine's bundled default; a custom config is passed as its folder."""
    return None if args.model_config == "smollm2" else args.model_path


def import_engine() -> tuple[Any, Any, Any]:
    """The engine's public classes, or a clear error while the engine is still being written."""
    try:
        import workers

        return workers.LLM, workers.AsyncLLMEngine, workers.SamplingParams
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"engine not available yet (workers.LLM: {exc!r})") from exc


def run_engine(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """Offline: one llm.generate over all requests. Online: AsyncLLMEngine with Poisson arrivals."""
    llm_cls, async_cls, sp_cls = import_engine()
    kwargs = dict(engine_kwargs(args), dtype=args.dtype, device=args.device)
    if args.mode == "online":
        return asyncio.run(run_engine_online(async_cls, sp_cls, args, wl, kwargs))

    t0 = time.perf_counter()
    llm = llm_cls(model=engine_model_arg(args), **kwargs)
    load_s = time.perf_counter() - t0
    warm = sp_cls(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([wl.requests[0].prompt_token_ids], warm)

    prompts = [r.prompt_token_ids for r in wl.requests]
    # token ids only, as vLLM's side runs (detokenize=False): the workload is random ids
    params = [sp_cls(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True,
                     detokenize=False) for r in wl.requests]
    sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(args.device)
    wall = time.perf_counter() - t0
    stats = []
    for req, out in zip(wl.requests, outs, strict=True):
        m = out.metrics
        latency = m.finished_time - m.arrival_time if m.finished_time is not None else None
        stats.append(RequestStat(tokens=len(out.token_ids), expected=req.max_tokens, ttft=m.ttft,
                                 tpot=m.tpot, latency=latency,
                                 head=list(out.token_ids[:HEAD_TOKENS]),
                                 ids=list(out.token_ids)))
    result = summarize(stats, wall)
    result["load_s"] = load_s
    result["engine_kwargs"] = {k: v for k, v in kwargs.items() if k != "device"}
    if args.device.startswith("cuda") and not args.no_bandwidth:
        result["bandwidth"] = decode_bandwidth(llm, sp_cls, args)
    return result


async def run_engine_online(
    async_cls: Any, sp_cls: Any, args: argparse.Namespace, wl: Workload, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Client-side TTFT/TPOT (includes output delivery), engine-side figures kept alongside."""
    t0 = time.perf_counter()
    engine = async_cls(model=engine_model_arg(args), **kwargs)
    await engine.start()
    load_s = time.perf_counter() - t0
    try:
        warm = sp_cls(temperature=0.0, max_tokens=4, ignore_eos=True)
        async for _ in engine.generate(wl.requests[0].prompt_token_ids, warm, request_id="warm"):
            pass
        start = time.monotonic()

        async def one(i: int, req: Request) -> tuple[RequestStat, dict[str, Any]]:
            await asyncio.sleep(max(0.0, start + req.arrival_offset - time.monotonic()))
            sent = time.monotonic()
            params = sp_cls(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True,
                            detokenize=False)
            first = final = None
            last: Any = None
            async for out in engine.generate(req.prompt_token_ids, params, request_id=f"r{i}"):
                now = time.monotonic()  # outputs are cumulative: the last one holds every token
                if out.token_ids and first is None:
                    first = now
                final, last = now, out
            m = last.metrics
            count = len(last.token_ids)
            tpot = (final - first) / (count - 1) if first is not None and count > 1 else None
            stat = RequestStat(tokens=count, expected=req.max_tokens,
                               ttft=first - sent if first is not None else None, tpot=tpot,
                               latency=final - sent if final is not None else None,
                               head=list(last.token_ids[:HEAD_TOKENS]),
                               ids=list(last.token_ids))
            return stat, {"ttft": m.ttft, "tpot": m.tpot}

        pairs = await asyncio.gather(*(one(i, r) for i, r in enumerate(wl.requests)))
        wall = time.monotonic() - start
    finally:
        await engine.shutdown()
    result = summarize([p[0] for p in pairs], wall)
    server_ttft = [p[1]["ttft"] for p in pairs if p[1]["ttft"] is not None]
    server_tpot = [p[1]["tpot"] for p in pairs if p[1]["tpot"] is not None]
    result.update(load_s=load_s, engine_ttft_p50=percentile(server_ttft, 50),
                  engine_ttft_p99=percentile(server_ttft, 99),
                  engine_tpot_p50=percentile(server_tpot, 50),
                  engine_tpot_p99=percentile(server_tpot, 99))
    return result


def decode_bandwidth(llm: Any, sp_cls: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Fraction of measured copy bandwidth one decode step achieves, per batch size.

    Two runs per batch size differ only in output length (fresh prompts each, so prefix caching
    cannot help either); the wall-time difference divided by the extra tokens is pure decode step
    time, the best of two runs each. Bytes per step = all weights once + the KV of every
    sequence at its mean context (`bench/common/gpu_bench.measure_decode`, which the GPU check
    runs too).
    """
    from transformers import AutoTokenizer

    from bench.common.gpu_bench import measure_decode

    path = Path(args.model_path)
    tok = AutoTokenizer.from_pretrained(path)
    weights = weight_bytes_read_per_step(path, args.dtype)
    kv_tok = kv_bytes_per_token(path, args.dtype)
    copy_bw = args.copy_bandwidth
    batches = [b for b in (int(x) for x in args.bw_batches.split(","))
               if b <= args.max_num_seqs]  # a larger one would not decode as one batch
    rows, _ = measure_decode(llm, sp_cls, tok, batches=batches, prompt_len=args.bw_prompt,
                             short=args.bw_short, long=args.bw_long, device=args.device,
                             weight_bytes=weights, kv_bytes_per_token=kv_tok,
                             copy_bytes_per_s=copy_bw, seed=args.seed, reps=2, warm=False)
    return {"weight_bytes": weights, "kv_bytes_per_token": kv_tok, "prompt_len": args.bw_prompt,
            "outputs": [args.bw_short, args.bw_long],
            "copy_gb_s": copy_bw / 1e9 if copy_bw else None, "rows": rows}
