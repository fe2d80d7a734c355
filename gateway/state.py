"""Everything the app holds between requests, built and torn down by the app's lifespan."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from billing.meter import UsageMeter
from caching.embedder import Embedder
from caching.factory import make_caches
from gateway.adapters.cache import AdapterCache
from gateway.auth import AuthWatcher, KeyCache
from gateway.budgets import BudgetReconciler, seed_budgets
from gateway.deployments import DeploymentRegistry
from gateway.deployments.build import DeploymentBuilder, configured
from gateway.deployments.discovery import WorkerDiscovery
from gateway.deployments.http_pool import HttpPool
from gateway.deployments.worker import client_tls
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import Tracing
from gateway.recent_refusals import RecentRefusals
from gateway.response_cache import ResponseCache
from gateway.routing.breaker import BreakerSettings
from gateway.routing.fallback import Fallbacks
from gateway.settings import Settings
from tenancy.db import make_engine, make_sessionmaker
from tenancy.keys import load_or_create_pepper
from tenancy.limits import Limiter, make_limiter

if TYPE_CHECKING:  # gateway.console imports gateway.deps, which imports this module
    from opentelemetry.sdk.trace import TracerProvider

    from gateway.console.sessions import ConsoleSessions
    from workers.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)

BACKGROUND_GRACE_S = 30.0  # how long shutdown waits on spawned writes (usage, cache) to settle


@dataclass
class GatewayState:
    settings: Settings
    db: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    keys: KeyCache
    adapters: AdapterCache
    watcher: AuthWatcher
    limiter: Limiter
    deployments: DeploymentRegistry
    http: HttpPool
    meter: UsageMeter
    fallbacks: Fallbacks
    cache: ResponseCache
    reconciler: BudgetReconciler
    metrics: GatewayMetrics
    console_sessions: ConsoleSessions  # console sign-ins: in process, or Redis for replicas
    builder: DeploymentBuilder  # makes deployments, at startup and at runtime
    background: set[asyncio.Task[None]] = field(default_factory=set)
    tracing: Tracing = field(default_factory=Tracing.off)  # docs/observability.md
    discovery: WorkerDiscovery | None = None  # workers that register in Redis
    refusals: RecentRefusals = field(default_factory=RecentRefusals)  # gateway/recent_refusals

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on its own, kept until done (shutdown awaits what is left), so a
        request that is cancelled still settles and stores what it must."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


async def open_state(settings: Settings, *, engine: AsyncLLMEngine | None = None,
                     tracer_provider: TracerProvider | None = None) -> GatewayState:
    """Connect, load deployments and start background tasks (the app's startup).

    `tracer_provider`: spans go there (tests); otherwise the settings make one."""
    db = make_engine(settings.database_url)
    sessionmaker = make_sessionmaker(db)
    pepper = load_or_create_pepper(secret_key=settings.secret_key,
                                   secret_file=settings.secret_file)
    keys = KeyCache(sessionmaker, pepper, negative_size=settings.auth_negative_cache_size)
    adapters = AdapterCache(sessionmaker, negative_size=settings.auth_negative_cache_size)
    limiter = make_limiter(redis_url=settings.redis_url, fail_open=settings.redis_fail_open,
                           timeout_s=settings.redis_timeout_s)
    registry = DeploymentRegistry(BreakerSettings(
        failure_threshold=settings.breaker_failure_threshold,
        window_s=settings.breaker_window_s, cooldown_s=settings.breaker_cooldown_s))
    metrics = GatewayMetrics(registry)
    http = HttpPool(max_connections=settings.upstream_max_connections)
    tracing = (Tracing.from_settings(settings) if tracer_provider is None
               else Tracing(tracer_provider, owned=False))
    state = GatewayState(
        settings=settings, db=db, sessionmaker=sessionmaker, keys=keys, adapters=adapters,
        watcher=AuthWatcher([keys, adapters], sessionmaker,
                            interval_s=settings.auth_poll_interval_s),
        limiter=limiter,
        deployments=registry,
        http=http,
        meter=UsageMeter(sessionmaker, flush_interval_s=settings.usage_flush_interval_s,
                         outbox_dir=outbox_dir(settings)),
        fallbacks=Fallbacks(registry, max_attempts=settings.route_max_attempts,
                            budget_s=settings.route_budget_s, metrics=metrics),
        cache=_response_cache(settings),
        reconciler=BudgetReconciler(sessionmaker, limiter,
                                    interval_s=settings.budget_reconcile_interval_s),
        metrics=metrics,
        tracing=tracing,
        console_sessions=_console_sessions(settings),
        refusals=RecentRefusals(hold_s=settings.rpm_refusal_hold_s),
        builder=DeploymentBuilder(
            settings, http, sessionmaker,
            worker_tls=client_tls(ca_file=settings.worker_tls_ca_file,
                                  cert_file=settings.worker_tls_cert_file,
                                  key_file=settings.worker_tls_key_file)),
    )
    await state.http.open()
    await seed_budgets(sessionmaker, state.limiter)
    configs, aliases = configured(settings, engine)
    templates = [c for c in configs if c.discover]
    for config in (c for c in configs if not c.discover):
        deployment = await state.builder.start(
            config, engine if config.name == "embedded" else None)
        state.deployments.add(deployment)
        logger.info("deployment %s serves model %s (%s, tier %s)", config.name,
                    config.model_name, config.provider, config.tier)
    if templates:
        if not settings.redis_url:
            raise ValueError("worker discovery (a deployment with discover: true) needs "
                             "SWITCHBOARD_REDIS_URL")
        state.discovery = WorkerDiscovery(
            templates, registry, redis_url=settings.redis_url,
            interval_s=settings.worker_stats_interval_s, build=state.builder.start)
        await state.discovery.start()
    for alias in aliases:
        state.deployments.set_alias(alias)
    await state.watcher.start()
    await state.meter.start()
    await state.reconciler.start()
    return state


async def close_state(state: GatewayState) -> None:
    if state.background:  # usage and cache writes still settling: bounded, never forever
        _, left = await asyncio.wait(set(state.background), timeout=BACKGROUND_GRACE_S)
        if left:
            logger.error("shutdown left %d background task(s) unfinished after %g s: %s",
                         len(left), BACKGROUND_GRACE_S,
                         ", ".join(sorted(getattr(t.get_coro(), "__qualname__", t.get_name())
                                          for t in left)))
            for task in left:
                task.cancel()
    await state.watcher.stop()
    await state.reconciler.stop()
    await state.meter.stop()
    if state.discovery is not None:
        await state.discovery.stop()
    for deployment in state.deployments.deployments():
        await deployment.close()
    await state.http.close()
    await state.cache.close()
    await state.limiter.close()
    await state.console_sessions.close()
    await state.db.dispose()
    await state.tracing.shutdown()  # flushes the last spans


def outbox_dir(settings: Settings) -> Path | None:
    """The usage outbox of this database: a folder per database under the configured one, so
    a process starting on one database never replays records meant for another."""
    if settings.usage_outbox_dir is None:
        return None
    url = make_url(settings.database_url).render_as_string(hide_password=True)
    return settings.usage_outbox_dir / hashlib.sha256(url.encode()).hexdigest()[:16]


def _console_sessions(settings: Settings) -> ConsoleSessions:
    from gateway.console.sessions import make_session_store

    return make_session_store(
        redis_url=settings.redis_url, ttl_s=settings.console_session_ttl_s,
        max_sessions=settings.console_max_sessions, timeout_s=settings.redis_timeout_s)


def _response_cache(settings: Settings) -> ResponseCache:
    exact, semantic = make_caches(
        redis_url=settings.redis_url,
        max_entries_per_tenant=settings.cache_max_entries_per_tenant,
        semantic_max_entries_per_tenant=settings.semantic_cache_max_entries_per_tenant,
        max_entry_bytes=settings.cache_max_entry_bytes)
    cache = ResponseCache(exact, semantic, Embedder(), default_ttl_s=settings.cache_ttl_s)
    if settings.semantic_threshold is not None:
        cache.default_threshold = settings.semantic_threshold
    return cache
