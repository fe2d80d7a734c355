"""Deployments and routing: tier, prices, health and breaker state, as the admin API's
`describe` reports them, plus resetting a breaker; and the workers' live engine figures."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import RedirectResponse, Response

from gateway.console.auth import AdminSession, SignedIn
from gateway.console.render import page
from gateway.console.routing import console_router
from gateway.deps import SessionDep, StateDep
from gateway.routes.admin.deployments import describe
from gateway.state import GatewayState
from tenancy import service

router = console_router()
POLL_SECONDS = 2


@router.get("/deployments")
async def deployments_page(request: Request, admin: AdminSession, state: StateDep
                           ) -> Response:
    return _deployments(request, admin, state)


@router.post("/deployments/{name}/breaker/reset")
async def reset_breaker(request: Request, name: str, admin: AdminSession, state: StateDep
                        ) -> Response:
    if state.deployments.get(name) is None:
        return _deployments(request, admin, state, notice=f"No deployment named '{name}'.",
                            status_code=404)
    state.deployments.health(name).breaker.reset()
    if request.headers.get("hx-request") == "true":
        return _deployments(request, admin, state, notice=f"Breaker of '{name}' reset.")
    return RedirectResponse("/console/deployments", status_code=303)


@router.get("/workers")
async def workers_page(request: Request, admin: AdminSession, state: StateDep,
                       session: SessionDep) -> Response:
    return page(request, "workers.html", {
        "admin": admin, "title": "Workers", "nav": "workers", "poll_s": POLL_SECONDS,
        "workers": await _workers(state, session)})


@router.get("/workers/panel")
async def workers_panel(request: Request, admin: AdminSession, state: StateDep,
                        session: SessionDep) -> Response:
    """The fragment the workers page polls every few seconds."""
    return page(request, "_workers_panel.html", {
        "admin": admin, "poll_s": POLL_SECONDS, "workers": await _workers(state, session)})


def _deployments(request: Request, admin: SignedIn, state: GatewayState, *,
                 notice: str | None = None, status_code: int = 200) -> Response:
    return page(request, "deployments.html", {
        "admin": admin, "title": "Deployments", "nav": "deployments", "notice": notice,
        "deployments": [describe(state, d) for d in state.deployments.deployments()]},
        fragment="_deployments_panel.html", status_code=status_code)


async def _workers(state: GatewayState, session: SessionDep) -> list[dict[str, Any]]:
    """Each deployment that reports engine figures, with its resident adapters by tier.

    At most one query (tenant names), and only when some adapter is resident."""
    workers = []
    for deployment in state.deployments.deployments():
        stats = deployment.stats()
        if not stats:
            continue
        tiers = await deployment.adapter_tiers() if deployment.serves_adapters else {}
        workers.append({"name": deployment.name, "model": deployment.config.model_name,
                        "stats": stats, "adapters": sorted(tiers.items()),
                        "tenants": deployment.tenant_tokens()})
    if any(w["adapters"] or w["tenants"] for w in workers):
        names = {t.id: t.name for t in await service.list_tenants(session)}
        for worker in workers:
            worker["adapters"] = [(_adapter_label(engine_name, names), tier)
                                  for engine_name, tier in worker["adapters"]]
            worker["tenants"] = _tenant_shares(worker["tenants"], names)
    return workers


def _tenant_shares(tokens: dict[str, int], tenant_names: dict[str, str]
                   ) -> list[tuple[str, int, float]]:
    """(tenant name, tokens, share of the engine's tokens), most served first."""
    total = sum(tokens.values()) or 1
    rows = [(tenant_names.get(t, t) if t else "(no tenant)", n, n / total)
            for t, n in tokens.items()]
    return sorted(rows, key=lambda row: -row[1])


def _adapter_label(engine_name: str, tenant_names: dict[str, str]) -> str:
    """`<tenant id>/<adapter>` as `<tenant name>/<adapter>`."""
    tenant_id, _, adapter = engine_name.partition("/")
    return f"{tenant_names.get(tenant_id, tenant_id)}/{adapter}"
