"""Everything the app holds between requests, built and torn down by the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from billing.meter import UsageMeter
from gateway.adapters.cache import AdapterCache
from gateway.auth import AuthWatcher, KeyCache
from gateway.budgets import seed_budgets
from gateway.deployments import DeploymentConfig, DeploymentRegistry, load_deployments_file
from gateway.deployments.base import Deployment
from gateway.deployments.http import HttpDeployment
from gateway.deployments.http_pool import HttpPool
from gateway.settings import Settings
from tenancy.db import make_engine, make_sessionmaker
from tenancy.keys import load_or_create_pepper
from tenancy.limits import Limiter, make_limiter
from workers.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)


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
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def build_deployment(self, config: DeploymentConfig,
                         engine: AsyncLLMEngine | None = None) -> Deployment:
        if config.provider == "openai":
            return HttpDeployment(config, self.http)
        from gateway.deployments.embedded import EmbeddedDeployment

        if engine is not None:
            return EmbeddedDeployment(config, engine)
        model = config.upstream_model
        return EmbeddedDeployment(config, AsyncLLMEngine(
            None if model in (None, "default") else model,
            device=self.settings.embedded_device,
            kv_cache_memory=self.settings.embedded_kv_cache_memory,
            max_num_seqs=self.settings.embedded_max_num_seqs,
            enable_lora=self.settings.embedded_enable_lora,
            max_loras=self.settings.embedded_max_loras,
            max_lora_rank=self.settings.embedded_max_lora_rank,
            max_cpu_loras=self.settings.embedded_max_cpu_loras,
        ))


async def open_state(settings: Settings, *, engine: AsyncLLMEngine | None = None) -> GatewayState:
    """Connect, load deployments and start background tasks (the app's startup)."""
    db = make_engine(settings.database_url)
    sessionmaker = make_sessionmaker(db)
    pepper = load_or_create_pepper(secret_key=settings.secret_key,
                                   secret_file=settings.secret_file)
    keys = KeyCache(sessionmaker, pepper, negative_size=settings.auth_negative_cache_size)
    adapters = AdapterCache(sessionmaker, negative_size=settings.auth_negative_cache_size)
    state = GatewayState(
        settings=settings, db=db, sessionmaker=sessionmaker, keys=keys, adapters=adapters,
        watcher=AuthWatcher([keys, adapters], sessionmaker,
                            interval_s=settings.auth_poll_interval_s),
        limiter=make_limiter(redis_url=settings.redis_url, fail_open=settings.redis_fail_open,
                             timeout_s=settings.redis_timeout_s),
        deployments=DeploymentRegistry(),
        http=HttpPool(max_connections=settings.upstream_max_connections),
        meter=UsageMeter(sessionmaker, flush_interval_s=settings.usage_flush_interval_s),
    )
    await state.http.open()
    await seed_budgets(sessionmaker, state.limiter)
    for config in _configured(settings, engine):
        deployment = state.build_deployment(config, engine)
        await deployment.start()
        state.deployments.add(deployment)
        logger.info("deployment %s serves model %s (%s)", config.name, config.model_name,
                    config.provider)
    await state.watcher.start()
    await state.meter.start()
    return state


async def close_state(state: GatewayState) -> None:
    if state.background:
        await asyncio.gather(*state.background, return_exceptions=True)
    await state.watcher.stop()
    await state.meter.stop()
    for deployment in state.deployments.deployments():
        await deployment.close()
    await state.http.close()
    await state.limiter.close()
    await state.db.dispose()


def _configured(settings: Settings, engine: AsyncLLMEngine | None) -> list[DeploymentConfig]:
    configs = []
    if settings.embedded_model != "none" or engine is not None:
        configs.append(DeploymentConfig(
            name="embedded", model_name=settings.embedded_model_name, provider="embedded",
            upstream_model=settings.embedded_model, tier=settings.embedded_tier,
            input_price_per_1m=settings.embedded_input_price_per_1m,
            output_price_per_1m=settings.embedded_output_price_per_1m,
            shared_prefix_cache=settings.embedded_shared_prefix_cache,
        ))
    if settings.deployments_file is not None:
        configs.extend(load_deployments_file(settings.deployments_file))
    return configs
