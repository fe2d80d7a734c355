"""Everything the app holds between requests, built and torn down by the app's lifespan."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from billing.meter import UsageMeter
from billing.pricing import ensure_price_version
from caching.embedder import Embedder
from caching.factory import make_caches
from gateway.adapters.cache import AdapterCache
from gateway.auth import AuthWatcher, KeyCache
from gateway.budgets import BudgetReconciler, seed_budgets
from gateway.deployments import DeploymentConfig, DeploymentRegistry
from gateway.deployments.base import Deployment
from gateway.deployments.config import HTTP_PROVIDERS, AliasConfig, Capabilities, load_routing_file
from gateway.deployments.discovery import WorkerDiscovery
from gateway.deployments.embedding import build_embedding_deployment
from gateway.deployments.http import HttpDeployment
from gateway.deployments.http_pool import HttpPool
from gateway.deployments.worker import WorkerDeployment, client_tls
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
    background: set[asyncio.Task[None]] = field(default_factory=set)
    tracing: Tracing = field(default_factory=Tracing.off)  # docs/observability.md
    discovery: WorkerDiscovery | None = None  # workers that register in Redis
    worker_tls: ssl.SSLContext | None = None  # mutual TLS to workers, when configured
    refusals: RecentRefusals = field(default_factory=RecentRefusals)  # gateway/recent_refusals

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on its own, kept until done (shutdown awaits what is left), so a
        request that is cancelled still settles and stores what it must."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def start_deployment(self, config: DeploymentConfig) -> Deployment:
        """Build, start and price a deployment found at runtime (a discovered worker)."""
        deployment = self.build_deployment(config)
        await deployment.start()
        await self.record_price(deployment)
        return deployment

    async def record_price(self, deployment: Deployment) -> None:
        """Enter the deployment's price in the price book (a new version if it changed), so
        its usage records point at the price they were charged at."""
        price = deployment.price
        async with self.sessionmaker() as session:
            price_id = await ensure_price_version(
                session, deployment=deployment.name, tier=deployment.config.tier,
                rates=price.rates(), source=price.source)
        deployment.price = replace(price, price_id=price_id)

    def build_deployment(self, config: DeploymentConfig,
                         engine: AsyncLLMEngine | None = None) -> Deployment:
        if config.mode == "embedding":
            return build_embedding_deployment(
                config, pool=self.http, worker_secret=self.settings.worker_secret,
                worker_tls=self.worker_tls, device=self.settings.embedding_device,
                max_batch_rows=self.settings.embedding_max_batch_rows,
                max_batch_tokens=self.settings.embedding_max_batch_tokens,
                max_request_tokens=self.settings.embedding_max_request_tokens)
        if config.provider == "worker":
            return WorkerDeployment(config, self.http, secret=self.settings.worker_secret,
                                    stats_interval_s=self.settings.worker_stats_interval_s,
                                    tls=self.worker_tls)
        if config.provider in HTTP_PROVIDERS:
            return HttpDeployment(config, self.http)
        if config.provider == "litellm":
            from gateway.deployments.external import LiteLLMDeployment  # imports litellm

            return LiteLLMDeployment(config)
        from gateway.deployments.embedded import EmbeddedDeployment  # imports the engine
        from workers.async_engine import AsyncLLMEngine

        if engine is not None:
            return EmbeddedDeployment(config, engine)
        spec = self.settings.embedded_engines().get(config.name)
        if spec is None:  # a `provider: embedded` entry of the deployments file
            spec = self.settings.embedded.model_copy(update={"model": config.upstream_model})
        return EmbeddedDeployment(config, AsyncLLMEngine(**spec.engine_kwargs()))


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
    tracing = (Tracing.from_settings(settings) if tracer_provider is None
               else Tracing(tracer_provider, owned=False))
    state = GatewayState(
        settings=settings, db=db, sessionmaker=sessionmaker, keys=keys, adapters=adapters,
        watcher=AuthWatcher([keys, adapters], sessionmaker,
                            interval_s=settings.auth_poll_interval_s),
        limiter=limiter,
        deployments=registry,
        http=HttpPool(max_connections=settings.upstream_max_connections),
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
        worker_tls=client_tls(ca_file=settings.worker_tls_ca_file,
                              cert_file=settings.worker_tls_cert_file,
                              key_file=settings.worker_tls_key_file),
    )
    await state.http.open()
    await seed_budgets(sessionmaker, state.limiter)
    configs, aliases = _configured(settings, engine)
    templates = [c for c in configs if c.discover]
    for config in (c for c in configs if not c.discover):
        deployment = state.build_deployment(
            config, engine if config.name == "embedded" else None)
        await deployment.start()
        await state.record_price(deployment)
        state.deployments.add(deployment)
        logger.info("deployment %s serves model %s (%s, tier %s)", config.name,
                    config.model_name, config.provider, config.tier)
    if templates:
        if not settings.redis_url:
            raise ValueError("worker discovery (a deployment with discover: true) needs "
                             "SWITCHBOARD_REDIS_URL")
        state.discovery = WorkerDiscovery(
            templates, registry, redis_url=settings.redis_url,
            interval_s=settings.worker_stats_interval_s, build=state.start_deployment)
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


def _configured(settings: Settings, engine: AsyncLLMEngine | None
                ) -> tuple[list[DeploymentConfig], list[AliasConfig]]:
    configs = []
    aliases: list[AliasConfig] = []
    engines = settings.embedded_engines()
    if engine is not None and "embedded" not in engines:  # an engine handed in (tests, bench)
        engines = {"embedded": settings.embedded, **engines}
    for name, spec in engines.items():
        configs.append(DeploymentConfig(
            name=name, model_name=spec.name, provider="embedded",
            upstream_model=spec.model, tier=spec.tier,
            input_price_per_1m=spec.input_price_per_1m,
            output_price_per_1m=spec.output_price_per_1m,
            capabilities=Capabilities(adapters=spec.enable_lora),
            shared_prefix_cache=spec.shared_prefix_cache,
            tool_call_parser=spec.tool_call_parser,
        ))
    if settings.embedding_model != "none":
        configs.append(DeploymentConfig(
            name="embedded-embedding", model_name=settings.embedding_model_name,
            provider="embedded", mode="embedding", upstream_model=settings.embedding_model,
            tier=settings.embedding_tier, input_price_per_1m=settings.embedding_input_price_per_1m,
            output_price_per_1m=Decimal(0)))
    if settings.deployments_file is not None:
        routing = load_routing_file(settings.deployments_file)
        configs.extend(routing.deployments)
        aliases = routing.aliases
    return configs, aliases


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
