"""A remote `switchboard worker`: the HTTP path, plus what only our own workers offer.

Compared with a plain OpenAI-compatible upstream, a worker
- reports its load (`/stats`: queue, running, KV use, resident adapters), polled here in the
  background so routing picks the least loaded worker and the one holding an adapter;
- can be drained (it then answers 503 `worker_draining` and is skipped until it resumes);
- serves tenants' LoRA adapters, loaded hot over its API from the adapter's path (storage
  the gateways and workers share) and tagged with the adapter id, so a re-created adapter of
  the same name replaces the old one on the worker instead of reusing it;
- keeps each tenant's prefix cache apart: the tenant id travels as `cache_salt`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import SecretStr

from gateway.deployments.base import AdapterRef, Call, UpstreamFailure, estimated_call
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.http import HttpDeployment
from gateway.deployments.http_pool import HttpPool
from gateway.errors import unavailable
from workers.engine.prefix_hash import PrefixSummary
from workers.engine.sampling_params import InvalidRequestError
from workers.lora.manager import AdapterBusyError
from workers.periodic import Periodic
from workers.protocol.events import Event
from workers.protocol.requests import OpenAIRequest

logger = logging.getLogger(__name__)
ADMIN_TIMEOUT = aiohttp.ClientTimeout(total=30)
STATS_TIMEOUT = aiohttp.ClientTimeout(total=2)
# Slow /stats answers in a row before a worker counts as gone. A refused connection or an
# error status counts at once; a slow answer may be a busy machine, not a dead worker.
SLOW_POLLS_BEFORE_DOWN = 3


def client_tls(*, ca_file: Path | None, cert_file: Path | None, key_file: Path | None
               ) -> ssl.SSLContext | None:
    """The gateway's side of mutual TLS with workers; None when none is configured."""
    if ca_file is None and cert_file is None:
        return None
    context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    if cert_file is not None:
        context.load_cert_chain(str(cert_file), None if key_file is None else str(key_file))
    return context


class WorkerDeployment(HttpDeployment):
    def __init__(self, config: DeploymentConfig, pool: HttpPool, *, secret: str = "",
                 stats_interval_s: float = 1.0, tls: ssl.SSLContext | None = None) -> None:
        if not config.api_key and not config.api_key_env and secret:
            config = config.model_copy(update={"api_key": SecretStr(secret)})
        super().__init__(config, pool)
        self.root = (config.base_url or "").rstrip("/").removesuffix("/v1")
        if tls is not None:
            self.tls = tls
        self.status: dict[str, Any] = {}  # the latest /stats answer
        self._summary: tuple[dict[str, Any], PrefixSummary | None] | None = None
        self.reachable = False
        self.slow_polls = 0  # /stats polls in a row that timed out
        self._registered: dict[str, str] = {}  # engine name -> adapter id this gateway loaded
        self._locks: dict[str, asyncio.Lock] = {}
        self._poller = Periodic(self.poll, interval_s=stats_interval_s,
                                name=f"stats-{config.name}")

    async def start(self) -> None:
        await self.poll()
        self._poller.start()

    async def close(self) -> None:
        await self._poller.stop()

    # ---- load and health ------------------------------------------------------------------

    async def poll(self) -> None:
        try:
            async with self._pool.session.get(f"{self.root}/stats", headers=self._headers,
                                              timeout=STATS_TIMEOUT, ssl=self.tls) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                self.status = await resp.json()
            self.reachable = True
            self.slow_polls = 0
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self.slow_polls = self.slow_polls + 1 if isinstance(exc, TimeoutError) else 0
            if self.reachable and 0 < self.slow_polls < SLOW_POLLS_BEFORE_DOWN:
                logger.info("worker %s answered /stats late (%d in a row)", self.name,
                            self.slow_polls)
                return  # still up, on its last answer's figures
            if self.reachable:
                logger.warning("worker %s stopped answering /stats: %r", self.name, exc)
            self.reachable = False
        if self.reachable:  # a restarted worker has forgotten its adapters: load them again
            reported = self.status.get("adapters") or {}
            for name in [n for n in self._registered if n not in reported]:
                self._registered.pop(name, None)

    @property
    def accepting(self) -> bool:
        """Whether new requests should go here: it answers and is neither loading nor draining."""
        return self.reachable and bool(self.status.get("ready"))

    @property
    def draining(self) -> bool:
        return bool(self.status.get("draining"))

    def stats(self) -> dict[str, float]:
        engine = self.status.get("stats") or {}
        stats = {"reachable": float(self.reachable), "accepting": float(self.accepting),
                 "num_waiting": float(engine.get("num_waiting", 0)),
                 "num_running": float(engine.get("num_running", 0)),
                 "kv_cache_usage": float(engine.get("kv_cache_usage", 0.0)),
                 "in_flight": float(self.status.get("in_flight", 0))}
        for name in ("prefix_cache_hit_rate", "num_preemptions"):  # the console shows them
            if isinstance(engine.get(name), int | float):
                stats[name] = float(engine[name])
        return stats

    def prefix_summary(self) -> PrefixSummary | None:
        raw = self.status.get("prefix")
        if not isinstance(raw, dict):
            return None
        cached = self._summary
        if cached is None or cached[0] is not raw:  # parsed once per /stats answer
            try:
                cached = (raw, PrefixSummary.from_json(raw))
            except ValueError as exc:
                logger.warning("worker %s sent a bad prefix summary: %s", self.name, exc)
                cached = (raw, None)
            self._summary = cached
        return cached[1]

    def kv_room(self) -> tuple[int, int] | None:
        engine = self.status.get("stats") or {}
        hot, capacity = engine.get("kv_hot_tokens"), engine.get("kv_capacity_tokens")
        if not isinstance(hot, int | float) or not isinstance(capacity, int | float):
            return None
        return (int(hot), int(capacity)) if capacity > 0 else None

    def tenant_tokens(self) -> dict[str, int]:
        tenants = self.status.get("tenants") or {}
        return {str(t): int(n) for t, n in tenants.items() if isinstance(n, int | float)}

    def load(self) -> float:
        """Queued requests plus KV pressure, as last reported (routing adds its own in-flight)."""
        engine = self.status.get("stats") or {}
        return float(engine.get("num_waiting", 0)) + float(engine.get("kv_cache_usage", 0.0))

    async def set_draining(self, on: bool) -> None:
        await self._admin("POST", "/admin/drain", {"drain": on})
        await self.poll()

    # ---- adapters -------------------------------------------------------------------------

    @property
    def serves_adapters(self) -> bool:
        return bool(self.status.get("serves_adapters"))

    def adapter_residency(self, engine_name: str) -> str | None:
        info = (self.status.get("adapters") or {}).get(engine_name)
        if info is None:
            return None
        registered = self._registered.get(engine_name)
        if registered is not None and info.get("adapter_id") not in (None, registered):
            return None  # an older registration of the name: not the adapter asked for
        return info.get("tier")

    async def adapter_tiers(self) -> dict[str, str]:
        data = await self._admin("GET", "/v1/lora_adapters")
        return {a["lora_name"]: a["tier"] for a in data.get("data", [])}

    async def load_adapter(self, adapter: AdapterRef, *, force: bool = False) -> None:
        name = adapter.engine_name
        if not force and self._registered.get(name) == adapter.adapter_id:
            return
        async with self._locks.setdefault(name, asyncio.Lock()):
            if not force and self._registered.get(name) == adapter.adapter_id:
                return
            await self._admin("POST", "/v1/load_lora_adapter", {
                "lora_name": name, "lora_path": adapter.path,
                "adapter_id": adapter.adapter_id, "pinned": adapter.pinned})
            self._registered[name] = adapter.adapter_id
            # Routing sees it now rather than at the next poll (which then gives the tier).
            self.status.setdefault("adapters", {})[name] = {
                "tier": "cpu", "adapter_id": adapter.adapter_id}

    async def unload_adapter(self, engine_name: str, *, wait_s: float = 0.0) -> None:
        async with self._locks.setdefault(engine_name, asyncio.Lock()):
            try:
                await self._admin("POST", "/v1/unload_lora_adapter",
                                  {"lora_name": engine_name, "wait_s": wait_s},
                                  missing_ok=True)  # not loaded there: nothing to do
            except UpstreamFailure as exc:  # a worker that is gone holds nothing
                logger.warning("worker %s unreachable while unloading %s: %s", self.name,
                               engine_name, exc.message)
            self._registered.pop(engine_name, None)
            (self.status.get("adapters") or {}).pop(engine_name, None)

    async def _admin(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                     missing_ok: bool = False) -> dict[str, Any]:
        """A call on the worker's own API, its errors mapped to the engine's exceptions."""
        try:
            async with self._pool.session.request(
                method, f"{self.root}{path}", headers=self._headers, timeout=ADMIN_TIMEOUT,
                data=None if body is None else json.dumps(body), ssl=self.tls,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError):
            raise UpstreamFailure(502, f"worker {self.name} is unreachable",
                                  code="upstream_unreachable") from None
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:
            data = {}
        error = data.get("error") if isinstance(data, dict) else None
        message = (error or {}).get("message") or f"worker answered HTTP {status}"
        if status == 404 and missing_ok:
            return {}
        if status == 409:
            raise AdapterBusyError(message)
        if 400 <= status < 500:
            raise InvalidRequestError(message, code=(error or {}).get("code"))
        if status >= 300:
            raise UpstreamFailure(502, f"worker {self.name} answered HTTP {status}")
        return data

    # ---- requests -------------------------------------------------------------------------

    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                adapter: AdapterRef | None = None) -> Call:
        call = estimated_call(self.config, request, chat=chat, adapter=None)
        call.adapter = adapter
        call.native = None if self.config.shared_prefix_cache else tenant_id  # the cache salt
        return call

    def upstream_fields(self, call: Call) -> dict[str, Any]:
        fields: dict[str, Any] = {"response_model": call.request.model}
        if call.adapter is not None:
            fields["model"] = call.adapter.engine_name
        else:
            fields["model"] = self.config.upstream_model or self.config.model_name
        if call.native is not None:
            fields["cache_salt"] = call.native
        if call.share is not None:  # the worker's fair-share scheduler (worker API fields)
            fields.update(tenant=call.share.tenant, engine_weight=call.share.weight,
                          priority=call.share.priority)
        return fields

    streams_whole = True  # a whole answer is asked as a stream and folded (see HttpDeployment)

    async def open(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
        await self._ensure_adapter(call)
        async for event in super().open(call, request_id=request_id):
            yield event

    async def _ensure_adapter(self, call: Call) -> None:
        if call.adapter is None:
            return
        try:
            await self.load_adapter(call.adapter)
        except (InvalidRequestError, AdapterBusyError) as exc:
            logger.error("adapter %s could not be loaded on worker %s: %s",
                         call.adapter.engine_name, self.name, exc)
            raise unavailable(f"The model '{call.request.model}' could not be loaded; "
                              "retry later.", code="adapter_unavailable") from None
