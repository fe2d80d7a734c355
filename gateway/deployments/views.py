"""What operators see of a deployment: its public config (no upstream secrets), effective
price, health and breaker state, and live load. The admin API and the console both show it."""

from __future__ import annotations

from typing import Any

from gateway.deployments.base import Deployment
from gateway.deployments.registry import DeploymentRegistry


def describe(registry: DeploymentRegistry, deployment: Deployment) -> dict[str, Any]:
    price = deployment.price
    return {
        **deployment.config.public(),
        "price": {"input_per_1m": str(price.input_per_1m),
                  "output_per_1m": str(price.output_per_1m),
                  "cached_input_per_1m": str(price.cached_per_1m), "source": price.source,
                  "price_id": price.price_id},
        "health": registry.health(deployment.name).public(),
        "load": deployment.stats(),
    }
