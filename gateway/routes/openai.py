"""OpenAI-compatible completions and models, for tenant keys."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.deployments.registry import AUTO
from gateway.deps import SessionDep, StateDep, TenantDep
from gateway.errors import model_not_found
from gateway.request_path import surface_route
from gateway.state import GatewayState
from gateway.surfaces import CHAT, COMPLETIONS
from tenancy import adapters as adapter_rows
from tenancy.context import KeyContext

router = APIRouter(prefix="/v1", tags=["openai"])
# the completions surfaces: plain routes at the app's top level (`request_path.SurfaceEndpoint`)
routes = [surface_route("/v1/chat/completions", CHAT),
          surface_route("/v1/completions", COMPLETIONS)]


@router.get("/models")
async def list_models(key: TenantDep, state: StateDep, session: SessionDep) -> JSONResponse:
    """Only the models this key may use: deployments, then the tenant's own adapters."""
    names = usable_models(state, key) + await usable_adapters(state, session, key)
    return JSONResponse({"object": "list", "data": [_model(name) for name in names]})


@router.get("/models/{model:path}")
async def get_model(model: str, key: TenantDep, state: StateDep,
                    session: SessionDep) -> JSONResponse:
    if model not in usable_models(state, key) and model not in await usable_adapters(
            state, session, key):
        raise model_not_found(model)
    return JSONResponse(_model(model))


def usable_models(state: GatewayState, key: KeyContext) -> list[str]:
    """Deployed models, then aliases and `auto`: those with a deployment the key may use."""
    registry = state.deployments
    names = [*registry.models(), *(a.name for a in registry.aliases())]
    if registry.deployments():
        names.append(AUTO)
    return [name for name in names if any(
        (key.may_use_model(d.config.model_name) or key.may_use_model(name))
        and key.may_use_tier(d.config.tier) for d in registry.route(name).deployments)]


async def usable_adapters(state: GatewayState, session: AsyncSession, key: KeyContext
                          ) -> list[str]:
    """The tenant's adapters the key may use, as "<base>:<name>" and by alias, where the key
    may use the base model and a deployment of it serves adapters."""
    bases = {name for name in usable_models(state, key) if any(
        d.serves_adapters and key.may_use_tier(d.config.tier)
        for d in state.deployments.route(name).deployments)}
    names: list[str] = []
    for adapter in await adapter_rows.list_adapters(session, tenant_id=key.tenant_id):
        if adapter.base_model in bases and key.may_use_adapter(adapter.name):
            names.append(f"{adapter.base_model}:{adapter.name}")
            if adapter.alias is not None:
                names.append(adapter.alias)
    return names


def _model(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "switchboard"}
