"""The engine's load figures: what the worker's /stats, routing and autoscaling read.

Gathered from the parts that own them (the scheduler, the KV pool, speculation, interjections,
stop checks, adapters) into one flat dict of numbers, the shape /stats serves.
"""

from __future__ import annotations

from typing import Any, Protocol

from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.speculative import SpecStats


class _Engine(Protocol):
    """What the figures are read from (`LLMEngine`)."""

    args: Any
    scheduler: Scheduler
    block_manager: BlockManager
    spec_stats: SpecStats
    adapters: Any  # AdapterResidency

    @property
    def num_interjections(self) -> int: ...

    @property
    def num_grammar_errors(self) -> int: ...


def engine_stats(engine: _Engine) -> dict[str, float]:
    scheduler, blocks = engine.scheduler, engine.block_manager
    stats = {
        "num_waiting": len(scheduler.waiting),
        "num_running": len(scheduler.running),
        "kv_cache_usage": blocks.usage,
        "num_preemptions": scheduler.num_preemptions,
        "prefix_cache_hit_rate": blocks.num_hit_tokens / max(blocks.num_queried_tokens, 1),
        "prefix_cache_hit_tokens": blocks.num_hit_tokens,
        "prefix_cache_queried_tokens": blocks.num_queried_tokens,
        "num_interjections": engine.num_interjections,
        "num_grammar_errors": engine.num_grammar_errors,
        "kv_capacity_tokens": blocks.num_blocks * blocks.block_size,
    }
    if blocks.enable_caching:
        hot = blocks.hot_blocks(engine.args.prefix_hot_window_s)
        stats["kv_hot_tokens"] = hot * blocks.block_size
    if scheduler.config.speculative is not None:
        stats.update(engine.spec_stats.figures())
    stats.update(engine.adapters.figures())
    return stats
