"""Deployments at runtime: list, add, remove (upstream secrets are never shown)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter

from gateway.deployments import DeploymentConfig
from gateway.deps import StateDep
from gateway.errors import bad_request, conflict, not_found

router = APIRouter(prefix="/deployments", tags=["admin"])


@router.get("")
async def list_deployments(state: StateDep) -> list[dict[str, Any]]:
    return [d.config.public() for d in state.deployments.deployments()]


@router.post("", status_code=201)
async def add_deployment(config: DeploymentConfig, state: StateDep) -> dict[str, Any]:
    if config.provider != "openai":
        raise bad_request("Only 'openai' (HTTP) deployments can be added at runtime.",
                          param="provider")
    url = urlsplit(config.base_url or "")
    if url.scheme not in ("http", "https") or not url.hostname:
        raise bad_request("base_url must be an http:// or https:// URL with a host.",
                          param="base_url")
    if state.deployments.get(config.name) is not None:
        raise conflict(f"A deployment named '{config.name}' already exists.")
    deployment = state.build_deployment(config)
    await deployment.start()
    state.deployments.add(deployment)
    return config.public()


@router.delete("/{name}")
async def remove_deployment(name: str, state: StateDep) -> dict[str, Any]:
    deployment = state.deployments.remove(name)
    if deployment is None:
        raise not_found(f"No deployment named '{name}'.")
    await deployment.close()
    return deployment.config.public()
