"""Deployments from configuration: which ones the settings and the deployments file ask for,
and a builder that turns one config into a started, priced deployment of the right kind.

It lives beside the deployment kinds so the app state only holds what was built: the state
owns one `DeploymentBuilder`, and the admin API and worker discovery add deployments through
it at runtime, as startup does."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.pricing import ensure_price_version
from gateway.deployments.base import Deployment
from gateway.deployments.config import (
    HTTP_PROVIDERS,
    AliasConfig,
    Capabilities,
    DeploymentConfig,
    load_routing_file,
)
from gateway.deployments.embedding import build_embedding_deployment
from gateway.deployments.http import HttpDeployment
from gateway.deployments.http_pool import HttpPool
from gateway.deployments.worker import WorkerDeployment
from gateway.settings import Settings

if TYPE_CHECKING:
    from workers.async_engine import AsyncLLMEngine


def configured(settings: Settings, engine: AsyncLLMEngine | None = None
               ) -> tuple[list[DeploymentConfig], list[AliasConfig]]:
    """The deployments and aliases the settings ask for: each embedded engine, the embedded
    embedding model, then the deployments file's entries. `engine`: one handed in (tests,
    benchmarks) serves as "embedded" when the settings name none."""
    configs = []
    aliases: list[AliasConfig] = []
    engines = settings.embedded_engines()
    if engine is not None and "embedded" not in engines:
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


@dataclass
class DeploymentBuilder:
    """Builds deployments with what they share: the settings, the HTTP pool, workers' TLS,
    and the price book they are priced in."""

    settings: Settings
    http: HttpPool
    sessionmaker: async_sessionmaker[AsyncSession]
    worker_tls: ssl.SSLContext | None = None

    def build(self, config: DeploymentConfig, engine: AsyncLLMEngine | None = None
              ) -> Deployment:
        """The deployment of `config`'s kind, not started. `engine`: the embedded engine to
        serve (a handed-in one, or an edited deployment's own); otherwise one is made from the
        settings' spec of that name."""
        settings = self.settings
        if config.mode == "embedding":
            return build_embedding_deployment(
                config, pool=self.http, worker_secret=settings.worker_secret,
                worker_tls=self.worker_tls, device=settings.embedding_device,
                max_batch_rows=settings.embedding_max_batch_rows,
                max_batch_tokens=settings.embedding_max_batch_tokens,
                max_request_tokens=settings.embedding_max_request_tokens)
        if config.provider == "worker":
            return WorkerDeployment(config, self.http, secret=settings.worker_secret,
                                    stats_interval_s=settings.worker_stats_interval_s,
                                    tls=self.worker_tls)
        if config.provider in HTTP_PROVIDERS:
            return HttpDeployment(config, self.http)
        if config.provider == "litellm":
            from gateway.deployments.external import LiteLLMDeployment  # imports litellm

            return LiteLLMDeployment(config, self.http)
        from gateway.deployments.embedded import EmbeddedDeployment  # imports the engine
        from workers.async_engine import AsyncLLMEngine

        if engine is not None:
            return EmbeddedDeployment(config, engine)
        spec = settings.embedded_engines().get(config.name)
        if spec is None:  # a `provider: embedded` entry of the deployments file
            spec = settings.embedded.model_copy(update={"model": config.upstream_model})
        return EmbeddedDeployment(config, AsyncLLMEngine(**spec.engine_kwargs()))

    async def record_price(self, deployment: Deployment) -> None:
        """Enter the deployment's price in the price book (a new version if it changed), so
        its usage records point at the price they were charged at."""
        price = deployment.price
        async with self.sessionmaker() as session:
            price_id = await ensure_price_version(
                session, deployment=deployment.name, tier=deployment.config.tier,
                rates=price.rates(), source=price.source)
        deployment.price = replace(price, price_id=price_id)

    async def start(self, config: DeploymentConfig, engine: AsyncLLMEngine | None = None
                    ) -> Deployment:
        """Built, started and priced: ready to add to the registry."""
        deployment = self.build(config, engine)
        await deployment.start()
        await self.record_price(deployment)
        return deployment
