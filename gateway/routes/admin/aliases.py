"""Aliases (virtual models) at runtime: a name for an ordered list of deployments."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway.deployments.config import AliasConfig
from gateway.deps import StateDep
from gateway.errors import bad_request, not_found

router = APIRouter(prefix="/aliases", tags=["admin"])


@router.get("")
async def list_aliases(state: StateDep) -> list[dict[str, Any]]:
    return [a.model_dump() for a in state.deployments.aliases()]


@router.put("/{name}")
async def put_alias(name: str, alias: AliasConfig, state: StateDep) -> dict[str, Any]:
    """Create or replace; every deployment it names must exist."""
    if alias.name != name:
        raise bad_request("The alias in the body must match the one in the path.",
                          param="name")
    try:
        state.deployments.set_alias(alias)
    except ValueError as exc:
        raise bad_request(str(exc), param="deployments") from None
    return alias.model_dump()


@router.delete("/{name}")
async def delete_alias(name: str, state: StateDep) -> dict[str, Any]:
    alias = state.deployments.remove_alias(name)
    if alias is None:
        raise not_found(f"No alias named '{name}'.")
    return alias.model_dump()
