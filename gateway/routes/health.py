"""Liveness for load balancers and scripts (no auth, no secrets)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.deps import StateDep

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(state: StateDep) -> JSONResponse:
    return JSONResponse({"status": "ok", "deployments": {
        d.name: {"model": d.config.model_name, **d.stats()}
        for d in state.deployments.deployments()
    }})
