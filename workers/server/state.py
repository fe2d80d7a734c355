"""What one worker process knows about itself: its engine, options, drain flag, adapters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.async_engine import AsyncLLMEngine
from workers.client import EmbeddedClient, PreparedCall
from workers.lora.manager import AdapterStatus
from workers.server.metrics import EngineShape, WorkerMetrics


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    model_name: str
    secret: str = ""  # the gateways' bearer token; empty: open (loopback development only)
    worker_id: str = "worker"
    advertise_url: str = ""  # how gateways reach this worker, announced with its heartbeat
    redis_url: str | None = None  # register in Redis for gateway discovery
    heartbeat_ttl_s: float = 6.0
    tracer_provider: Any = None  # an opentelemetry TracerProvider, or None for no traces
    tool_call_parser: str = "hermes"  # how tool calls are read out of this model's text


class WorkerState:
    def __init__(self, engine: AsyncLLMEngine, options: WorkerOptions) -> None:
        self.engine = engine
        self.options = options
        self.client = EmbeddedClient(engine, options.model_name,
                                     tool_call_parser=options.tool_call_parser)
        self.metrics = WorkerMetrics(self.engine_stats, model_name=options.model_name,
                                     shape=self.engine_shape,
                                     adapters=lambda: self.engine.loras_seen())
        self.ready = False  # the model is loaded and the step loop runs
        self.draining = False  # finish what runs, take nothing new
        self.in_flight = 0
        self.adapter_ids: dict[str, str | None] = {}  # engine name -> the caller's tag for it
        self.adapter_locks: dict[str, asyncio.Lock] = {}
        # Called as each request ends (traces record the engine's queue/prefill/decode here).
        self.on_finish: Callable[[PreparedCall], None] | None = None

    @property
    def serves_adapters(self) -> bool:
        core = self.engine.engine
        return core is not None and core.loras is not None

    def engine_shape(self) -> EngineShape | None:
        """The KV cache's and adapter slots' sizes (None before the model is loaded)."""
        core = self.engine.engine
        if core is None:
            return None
        blocks = core.block_manager
        return EngineShape(block_size=blocks.block_size, num_blocks=blocks.num_blocks,
                           prefix_caching=blocks.enable_caching,
                           max_loras=None if core.loras is None else core.loras.max_loras)

    def adapter_path(self, name: str) -> str | None:
        """Where an adapter was loaded from (vLLM's `root` for it in /v1/models)."""
        core = self.engine.engine
        entry = None if core is None or core.loras is None else core.loras.entries.get(name)
        return None if entry is None else entry.path

    def engine_stats(self) -> dict[str, float]:
        return self.engine.stats() if self.engine.engine is not None else {}

    def prefix_summary(self) -> dict[str, Any] | None:
        """The prefix cache's Bloom summary, for gateways that route by cached prefix."""
        if self.engine.engine is None:
            return None
        summary = self.engine.prefix_summary()
        return None if summary is None else summary.to_json()

    async def adapters(self) -> dict[str, dict[str, Any]]:
        """The adapters now (waits for the step in flight)."""
        return self._describe_adapters(await self.engine.list_loras())

    def adapters_seen(self) -> dict[str, dict[str, Any]]:
        """The adapters as of the last step, without waiting for the one in flight."""
        return self._describe_adapters(self.engine.loras_seen())

    def _describe_adapters(self, statuses: list[AdapterStatus]) -> dict[str, dict[str, Any]]:
        if not self.serves_adapters:
            return {}
        return {s.name: {"tier": s.tier, "pinned": s.pinned, "num_requests": s.num_requests,
                         "rank": s.rank, "adapter_id": self.adapter_ids.get(s.name)}
                for s in statuses}

    async def describe(self) -> dict[str, Any]:
        """/stats, and the heartbeat's payload: what gateways route on."""
        return {
            "worker_id": self.options.worker_id, "url": self.options.advertise_url,
            "model": self.options.model_name, "ready": self.ready and not self.draining,
            "draining": self.draining, "in_flight": self.in_flight,
            "serves_adapters": self.serves_adapters,
            "stats": self.engine_stats(), "adapters": self.adapters_seen() if self.ready else {},
            "tenants": self.engine.tenant_tokens(),  # the fair share, "" for no tenant
            "prefix": self.prefix_summary(),
        }
