"""HF transformers as systems of bench/engine_throughput.py, with the engine's weights, dtype
and device: `hf_static` (`generate()` over fixed, left-padded batches in arrival order) and
`hf_batch` (transformers' continuous batching, each request with its own max_new_tokens, under
the engine's KV budget and limits). Runs in the child for `--only hf_static` / `hf_batch`."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from bench.common.model_folders import kv_bytes_per_token
from bench.common.throughput_stats import HEAD_TOKENS, RequestStat, summarize, sync, tpot_of
from bench.common.workload import Request, Workload

HF_PAGE_SIZE = 256  # transformers' default ContinuousBatchingConfig.page_size


def load_hf(args: argparse.Namespace, attn: str) -> Any:
    """The HF reference model with the same weights, dtype and device as the engine."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype,
                                                 attn_implementation=attn)
    return model.to(args.device).eval()


def pad_id_of(model: Any) -> int:
    """The pad id HF should use (SmolLM2 pads with its EOS id)."""
    cfg = model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad)


def run_hf_static(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """`generate()` over fixed batches in arrival order, left-padded; a batch runs to its longest.

    `eos_token_id=[]` turns EOS stopping off (None would fall back to the model's EOS id).
    """
    import torch
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    model = load_hf(args, "sdpa")
    load_s = time.perf_counter() - t0
    pad = pad_id_of(model)

    def gen(batch: list[Request]) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = [[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch]
        mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                for r in batch]
        max_new = max(r.max_tokens for r in batch)
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=[],
                                  pad_token_id=pad)
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor(ids, device=args.device),
                                 attention_mask=torch.tensor(mask, device=args.device),
                                 generation_config=config)
        new = out[:, width:].tolist()
        if any(len(row) != max_new for row in new):
            raise RuntimeError(f"hf_static generated {len(new[0])} tokens, expected {max_new}")
        return new

    warm = wl.requests[0]
    gen([Request(prompt_token_ids=warm.prompt_token_ids, max_tokens=4)])
    stats: list[RequestStat] = []
    wasted = 0
    sync(args.device)
    t0 = time.perf_counter()
    bs = args.static_batch_size
    for i in range(0, len(wl.requests), bs):
        batch = wl.requests[i : i + bs]
        new = gen(batch)
        done = time.perf_counter() - t0
        for req, row in zip(batch, new, strict=True):
            wasted += len(row) - req.max_tokens
            stats.append(RequestStat(tokens=req.max_tokens, expected=req.max_tokens,
                                     latency=done, head=row[: min(HEAD_TOKENS, req.max_tokens)],
                                     ids=row[: req.max_tokens]))
    wall = time.perf_counter() - t0
    result = summarize(stats, wall)
    result.update(load_s=load_s, wasted_tokens=wasted, batch_size=bs)
    return result


def run_hf_batch(args: argparse.Namespace, wl: Workload) -> dict[str, Any]:
    """HF continuous batching through its manager, so each request keeps its own max_new_tokens.

    `generate_batch()` takes one max_new_tokens for all inputs; `add_request()` takes one per
    request, plus `eos_token_id=-1` (EOS stopping off). The manager is entered once, warmed with
    a short request, then timed; `record_timestamps` gives per-token times for TTFT/TPOT.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    t0 = time.perf_counter()
    model = load_hf(args, args.hf_batch_attn)
    load_s = time.perf_counter() - t0
    per_token = kv_bytes_per_token(Path(args.model_path), args.dtype)
    num_blocks = math.ceil(args.kv_cache_bytes / (HF_PAGE_SIZE * per_token))
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=wl.max_output, eos_token_id=[],
                                  pad_token_id=pad_id_of(model))
    cb_config = continuous_batching_config(
        ContinuousBatchingConfig,
        page_size=HF_PAGE_SIZE,
        num_blocks=num_blocks,
        max_batch_tokens=args.max_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        auto_switch_to_flash=False,  # keep the attention we were asked to measure
    )

    def wait(mgr: Any, results: dict[str, Any], until: float | None, want: int) -> None:
        """Collect finished results until `until` (perf_counter) or `want` results are in."""
        while len(results) < want:
            left = 1.0 if until is None else until - time.perf_counter()
            if left <= 0:
                return
            res = mgr.get_result(timeout=min(left, 1.0))
            if res is None:
                if not mgr.is_running():
                    raise RuntimeError("HF continuous batching thread stopped")
                continue
            if res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"HF request {res.request_id} failed: {res.error}")
                results[res.request_id] = res

    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=60
    ) as mgr:
        warm: dict[str, Any] = {}
        mgr.add_request(wl.requests[0].prompt_token_ids, request_id="warm", max_new_tokens=4,
                        eos_token_id=-1)
        wait(mgr, warm, None, 1)
        results: dict[str, Any] = {}
        sync(args.device)
        start = time.perf_counter()
        for i, req in enumerate(wl.requests):
            if args.mode == "online":
                wait(mgr, results, start + req.arrival_offset, len(wl.requests))
                time.sleep(max(0.0, start + req.arrival_offset - time.perf_counter()))
            mgr.add_request(req.prompt_token_ids, request_id=f"r{i}", max_new_tokens=req.max_tokens,
                            eos_token_id=-1, record_timestamps=True)
        wait(mgr, results, None, len(wl.requests))
        wall = time.perf_counter() - start
        resolved = mgr.continuous_batching_config

    stats = []
    for i, req in enumerate(wl.requests):
        res = results[f"r{i}"]
        ts = res.timestamps or []
        stats.append(RequestStat(
            tokens=len(res.generated_tokens), expected=req.max_tokens,
            ttft=ts[0] - res.created_time if ts else None, tpot=tpot_of(ts),
            latency=res.lifespan[1] - res.created_time if res.lifespan[1] > 0 else None,
            head=list(res.generated_tokens[:HEAD_TOKENS]), ids=list(res.generated_tokens)))
    result = summarize(stats, wall)
    result.update(load_s=load_s, attn=model.config._attn_implementation,
                  hf_cb_config={"page_size": getattr(resolved, "page_size", None)
                                or getattr(resolved, "block_size", None),
                                "num_blocks": resolved.num_blocks,
                                "max_batch_tokens": resolved.max_batch_tokens,
                                "max_requests_per_batch": resolved.max_requests_per_batch,
                                "use_cuda_graph": list(resolved.use_cuda_graph),
                                "use_async_batching": resolved.use_async_batching})
    return result


def continuous_batching_config(cls: Any, **values: Any) -> Any:
    """`ContinuousBatchingConfig(**values)` across transformers 5.x: 5.17 (the lent GPU
    machines' image) calls the page size `block_size` and has no `auto_switch_to_flash` (it
    switches to a flash kernel only where one is installed: none is there)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    if "page_size" not in names and "block_size" in names:
        values["block_size"] = values.pop("page_size")
    return cls(**{k: v for k, v in values.items() if k in names})
