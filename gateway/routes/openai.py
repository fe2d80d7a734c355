"""OpenAI-compatible completions and models, for tenant keys."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.deps import StateDep, TenantDep
from gateway.errors import model_not_found
from gateway.request_path import serve_completion
from gateway.state import GatewayState
from tenancy.context import KeyContext

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await serve_completion(request, chat=True)


@router.post("/completions")
async def completions(request: Request) -> Response:
    return await serve_completion(request, chat=False)


@router.get("/models")
async def list_models(key: TenantDep, state: StateDep) -> JSONResponse:
    """Only the models this key may use."""
    return JSONResponse({"object": "list", "data": [
        _model(name) for name in usable_models(state, key)
    ]})


@router.get("/models/{model:path}")
async def get_model(model: str, key: TenantDep, state: StateDep) -> JSONResponse:
    if model not in usable_models(state, key):
        raise model_not_found(model)
    return JSONResponse(_model(model))


def usable_models(state: GatewayState, key: KeyContext) -> list[str]:
    return [
        name for name in state.deployments.models()
        if key.may_use_model(name) and any(key.may_use_tier(t)
                                           for t in state.deployments.tiers(name))
    ]


def _model(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "switchboard"}
