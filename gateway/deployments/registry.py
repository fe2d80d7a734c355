"""Model name -> deployment. Aliases, tiers and fallback chains (a later issue) extend `route`."""

from __future__ import annotations

from gateway.deployments.base import Deployment


class DeploymentRegistry:
    def __init__(self) -> None:
        self._by_name: dict[str, Deployment] = {}
        self._by_model: dict[str, list[Deployment]] = {}

    def add(self, deployment: Deployment) -> None:
        if deployment.name in self._by_name:
            raise ValueError(f"deployment {deployment.name!r} already exists")
        self._by_name[deployment.name] = deployment
        self._by_model.setdefault(deployment.config.model_name, []).append(deployment)

    def remove(self, name: str) -> Deployment | None:
        deployment = self._by_name.pop(name, None)
        if deployment is not None:
            chain = self._by_model[deployment.config.model_name]
            chain.remove(deployment)
            if not chain:
                del self._by_model[deployment.config.model_name]
        return deployment

    def get(self, name: str) -> Deployment | None:
        return self._by_name.get(name)

    def route(self, model: str) -> list[Deployment]:
        """The deployments that may serve `model`, in the order to try them."""
        return list(self._by_model.get(model, ()))

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def deployments(self) -> list[Deployment]:
        return list(self._by_name.values())

    def tiers(self, model: str) -> set[str]:
        return {d.config.tier for d in self._by_model.get(model, ())}
