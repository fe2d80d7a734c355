"""Teacher-forced perplexity through a runner's own model, kernels and KV pool: the yardstick
for quantization (docs/engine.md, "Quantization").

The text runs in chunks of `chunk` tokens, each after the ones before it, as chunked prefill
runs a long prompt: every chunk after the first reads its context back from the pool, so
with an int8 pool nearly every attention score reads quantized K/V (all but the chunk's own
tokens). `chunk=1` walks the text as decode steps, through the decode kernel.

It writes the pool's first blocks: use it on a runner with nothing in flight.
"""

from __future__ import annotations

import math

import torch

from workers.runner.attention import build_metadata
from workers.runner.model_runner import ModelRunner


@torch.inference_mode()
def perplexity(runner: ModelRunner, token_ids: list[int], chunk: int = 32) -> float:
    """exp of the mean negative log-likelihood of token_ids[1:] given what precedes each."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    bs = runner.block_size
    if -(-len(token_ids) // bs) > runner.num_blocks:
        raise ValueError("the text does not fit in the runner's KV pool")
    table = list(range(-(-len(token_ids) // bs)))
    config = runner.model.config
    group = config.num_attention_heads // config.num_key_value_heads
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, chunk):
        ids = token_ids[start : min(start + chunk, len(token_ids) - 1)]
        meta = build_metadata(
            [(start, len(ids), table)], bs, config.num_key_value_heads, group, runner.device,
            runner.dtype,
            decode_kernel=None if runner.attention_backend == "torch" else runner.attention_backend,
            prefill_kernel=runner.prefill_attention, workspace=runner.workspace)
        positions = torch.arange(start, start + len(ids), device=runner.device)
        hidden = runner.model(torch.tensor(ids, device=runner.device), positions,
                              runner.kv_caches, meta, bs)
        logprobs = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
        targets = torch.tensor(token_ids[start + 1 : start + 1 + len(ids)], device=runner.device)
        nll -= float(logprobs.gather(1, targets[:, None]).sum())
        count += len(ids)
    return math.exp(nll / count)
