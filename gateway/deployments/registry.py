"""Model names, aliases and `auto` -> the deployments that may serve them, with their health."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.deployments.base import Deployment
from gateway.deployments.config import AliasConfig
from gateway.routing.breaker import BreakerSettings
from gateway.routing.health import DeploymentHealth

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Route:
    """The deployments a name may go to, before policy and health, and how to order them."""

    deployments: list[Deployment]
    policy: str  # "ordered" (as configured) or "cost" (cheapest first)
    alias: bool


class DeploymentRegistry:
    def __init__(self, breaker: BreakerSettings | None = None) -> None:
        self._breaker = breaker or BreakerSettings()
        self._by_name: dict[str, Deployment] = {}
        self._by_model: dict[str, list[Deployment]] = {}
        self._aliases: dict[str, AliasConfig] = {}
        self._health: dict[str, DeploymentHealth] = {}

    def add(self, deployment: Deployment) -> None:
        if deployment.name in self._by_name:
            raise ValueError(f"deployment {deployment.name!r} already exists")
        if deployment.config.model_name in self._aliases or deployment.config.model_name == AUTO:
            raise ValueError(f"model name {deployment.config.model_name!r} is an alias")
        self._by_name[deployment.name] = deployment
        self._by_model.setdefault(deployment.config.model_name, []).append(deployment)
        self._health[deployment.name] = DeploymentHealth.with_settings(self._breaker)

    def remove(self, name: str) -> Deployment | None:
        deployment = self._by_name.pop(name, None)
        if deployment is not None:
            chain = self._by_model[deployment.config.model_name]
            chain.remove(deployment)
            if not chain:
                del self._by_model[deployment.config.model_name]
            del self._health[name]
        return deployment

    def replace(self, old: Deployment, new: Deployment) -> None:
        """Swap a deployment for its edited self, keeping its place and its health."""
        health = self._health[old.name]
        chain = self._by_model[old.config.model_name]
        index = chain.index(old)
        self.remove(old.name)
        self.add(new)
        if new.config.model_name == old.config.model_name:
            chain = self._by_model[new.config.model_name]
            chain.remove(new)
            chain.insert(index, new)
        self._health[new.name] = health

    def get(self, name: str) -> Deployment | None:
        return self._by_name.get(name)

    def health(self, name: str) -> DeploymentHealth:
        return self._health[name]

    def set_alias(self, alias: AliasConfig) -> None:
        if alias.name == AUTO or alias.name in self._by_model:
            raise ValueError(f"alias {alias.name!r} is already a model name")
        missing = [d for d in alias.deployments if d not in self._by_name]
        if missing:
            raise ValueError(f"alias {alias.name!r} names unknown deployments: {missing}")
        self._aliases[alias.name] = alias

    def remove_alias(self, name: str) -> AliasConfig | None:
        return self._aliases.pop(name, None)

    def aliases(self) -> list[AliasConfig]:
        return list(self._aliases.values())

    def route(self, model: str, *, mode: str = "chat") -> Route:
        """The deployments that may serve `model` in `mode` ("chat" or "embedding"): an
        alias's, `auto`'s (all), or the model's. A model with no deployment in that mode keeps
        its others, which refuse the request with a 400 naming the endpoint that serves them."""
        alias = self._aliases.get(model)
        if alias is not None:
            found = [self._by_name[n] for n in alias.deployments
                     if n in self._by_name and self._by_name[n].config.mode == mode]
            return Route(found, alias.policy, alias=True)
        if model == AUTO:
            return Route([d for d in self._by_name.values() if d.config.mode == mode], "cost",
                         alias=True)
        chain = self._by_model.get(model, [])
        return Route([d for d in chain if d.config.mode == mode] or list(chain), "cost",
                     alias=False)

    def models(self) -> list[str]:
        """Deployed model names (aliases and `auto` are listed separately)."""
        return sorted(self._by_model)

    def deployments(self) -> list[Deployment]:
        return list(self._by_name.values())

    def tiers(self, model: str) -> set[str]:
        return {d.config.tier for d in self.route(model).deployments}
