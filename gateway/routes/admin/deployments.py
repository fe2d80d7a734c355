"""Deployments at runtime: list with health and effective price, add, edit, remove, reset a
breaker. Upstream secrets are never shown. Changes apply to this replica; the YAML file is
what every replica starts from."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gateway.deployments import DeploymentConfig
from gateway.deployments.base import Deployment
from gateway.deployments.config import Capabilities
from gateway.deployments.views import describe
from gateway.deployments.worker import WorkerDeployment
from gateway.deps import StateDep
from gateway.errors import APIError, bad_request, conflict, not_found
from gateway.state import GatewayState

router = APIRouter(prefix="/deployments", tags=["admin"])


class DeploymentEdit(BaseModel):
    """What can change in place; absent fields stay as they are."""

    model_config = ConfigDict(extra="forbid")

    tier: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    input_price_per_1m: Annotated[Decimal, Field(ge=0)] | None = None
    output_price_per_1m: Annotated[Decimal, Field(ge=0)] | None = None
    cached_input_price_per_1m: Annotated[Decimal, Field(ge=0)] | None = None
    context_window: Annotated[int, Field(ge=1)] | None = None
    capabilities: Capabilities | None = None
    weight: Annotated[int, Field(ge=1, le=1000)] | None = None
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    timeout_s: Annotated[float, Field(gt=0)] | None = None


@router.get("")
async def list_deployments(state: StateDep) -> list[dict[str, Any]]:
    return [describe(state.deployments, d) for d in state.deployments.deployments()]


@router.get("/{name}")
async def get_deployment(name: str, state: StateDep) -> dict[str, Any]:
    return describe(state.deployments, _find(state, name))


@router.post("", status_code=201)
async def add_deployment(config: DeploymentConfig, state: StateDep) -> dict[str, Any]:
    if config.provider == "embedded":
        raise bad_request("Embedded engines start with the gateway; add worker, openai or "
                          "litellm deployments at runtime.", param="provider")
    if config.discover:
        raise bad_request("Discovered worker pools come from the deployments file; add one "
                          "worker here by its base_url.", param="discover")
    _check_url(config)
    if state.deployments.get(config.name) is not None:
        raise conflict(f"A deployment named '{config.name}' already exists.")
    deployment = await state.builder.start(config)
    try:
        state.deployments.add(deployment)
    except ValueError as exc:
        await deployment.close()
        raise bad_request(str(exc), param="model_name") from None
    return describe(state.deployments, deployment)


@router.patch("/{name}")
async def edit_deployment(name: str, edit: DeploymentEdit, state: StateDep
                          ) -> dict[str, Any]:
    """Tier, prices, window, capabilities, weight and limits change without a restart."""
    old = _find(state, name)
    changes = edit.model_dump(exclude_unset=True)
    if old.config.provider == "embedded" and set(changes) - {
            "tier", "input_price_per_1m", "output_price_per_1m", "cached_input_price_per_1m",
            "weight"}:
        raise bad_request("The embedded engine's window and capabilities come from its "
                          "settings; only tier, prices and weight can change here.")
    config = DeploymentConfig.model_validate({**old.config.model_dump(), **changes})
    new = _rebuilt(state, old, config)
    if config.provider != "embedded":
        await new.start()
    if config.configured_price() is None:
        new.price = old.price  # as the provider's price list gave it at start
    await state.builder.record_price(new)
    state.deployments.replace(old, new)
    if config.provider != "embedded":
        await old.close()  # its background work (a worker's stats poll) ends here
    return describe(state.deployments, new)


@router.delete("/{name}")
async def remove_deployment(name: str, state: StateDep) -> dict[str, Any]:
    deployment = _find(state, name)
    if deployment.config.provider == "embedded":
        raise bad_request("The embedded engine cannot be removed at runtime.")
    info = describe(state.deployments, deployment)
    state.deployments.remove(name)
    await deployment.close()
    return info


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drain: bool = True  # false: take requests again


@router.post("/{name}/drain")
async def drain_deployment(name: str, state: StateDep, body: DrainRequest | None = None
                           ) -> dict[str, Any]:
    """A worker finishes what it runs and takes nothing new, from any gateway (the worker
    itself refuses); ready to stop or upgrade once `in_flight` is 0."""
    deployment = _find(state, name)
    if not isinstance(deployment, WorkerDeployment):
        raise bad_request("Only worker deployments can be drained.")
    await deployment.set_draining((body or DrainRequest()).drain)
    return describe(state.deployments, deployment)


@router.post("/{name}/breaker/reset")
async def reset_breaker(name: str, state: StateDep) -> dict[str, Any]:
    deployment = _find(state, name)
    state.deployments.health(name).breaker.reset()
    return describe(state.deployments, deployment)


def _find(state: GatewayState, name: str) -> Deployment:
    deployment = state.deployments.get(name)
    if deployment is None:
        raise not_found(f"No deployment named '{name}'.")
    return deployment


def _check_url(config: DeploymentConfig) -> None:
    if config.base_url is None:
        return
    url = urlsplit(config.base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise bad_request("base_url must be an http:// or https:// URL with a host.",
                          param="base_url")


def _rebuilt(state: GatewayState, old: Deployment, config: DeploymentConfig) -> Deployment:
    """The same upstream under the edited config: HTTP deployments share the pool, so a new
    object costs nothing; the embedded engine keeps its engine."""
    engine = getattr(old, "engine", None)
    new = state.builder.build(config, engine)
    if new.__class__ is not old.__class__:
        raise APIError(500, "deployment type changed", type_="server_error")
    return new
