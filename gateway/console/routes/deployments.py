"""Deployments and routing: tier, prices, health and breaker state (as the admin API shows
them: `gateway.deployments.views`), plus resetting a breaker; and each deployment's live
figures (the workers page), whichever kind it is."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import RedirectResponse, Response

from gateway.console.auth import AdminSession, SignedIn
from gateway.console.render import page, percent
from gateway.console.routing import console_router
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.views import describe
from gateway.deps import SessionDep, StateDep
from gateway.state import GatewayState
from tenancy import tenants

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
        "deployments": [describe(state.deployments, d)
                        for d in state.deployments.deployments()]},
        fragment="_deployments_panel.html", status_code=status_code)


# What the workers page shows of a deployment's `stats()`, in this order, each only where the
# deployment reports it: the embedded engine reports engine figures (queue, KV, prefix cache,
# adapters), a remote worker the same plus its reachability and requests in flight, the
# in-process embedding model its batcher's queued rows, an HTTP or litellm upstream nothing.
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("num_waiting", "Queue depth", "count"),
    ("num_running", "Running", "count"),
    ("in_flight", "In flight", "count"),
    ("queued_rows", "Queued rows", "count"),
    ("kv_cache_usage", "KV cache use", "percent"),
    ("prefix_cache_hit_rate", "Prefix-cache hits", "percent"),
    ("num_preemptions", "Preemptions", "count"),
    ("num_loras", "Adapters", "count"),
    ("num_loras_on_device", "Adapters on device", "count"),
)


def deployment_kind(config: DeploymentConfig) -> str:
    """What serves a deployment, in the console's words."""
    if config.provider == "embedded":
        return "embedding model" if config.mode == "embedding" else "embedded engine"
    if config.provider == "worker":
        return "remote worker"
    if config.provider == "litellm":
        return "litellm upstream"
    return "HTTP upstream"


def figures(stats: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(stat key, label, shown value) of each figure in FIGURES that `stats` holds as a
    number; whatever a deployment leaves out (or sends as something else) is not shown."""
    rows = []
    for key, label, shape in FIGURES:
        value = stats.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        rows.append((key, label, percent(value) if shape == "percent" else str(int(value))))
    return rows


def _state(stats: dict[str, Any]) -> str | None:
    """A remote worker's reachability and draining, where the deployment reports them."""
    if "reachable" not in stats:
        return None
    if not stats["reachable"]:
        return "unreachable"
    return "accepting" if stats.get("accepting", 1.0) else "not accepting"


async def _workers(state: GatewayState, session: SessionDep) -> list[dict[str, Any]]:
    """Every deployment with the live figures it reports (none for an HTTP upstream), and,
    for our engines, the tenants' shares and the resident adapters by tier.

    At most one query (tenant names), and only when some adapter is resident."""
    workers = []
    for deployment in state.deployments.deployments():
        stats = deployment.stats() or {}
        kv = stats.get("kv_cache_usage")
        tiers = await deployment.adapter_tiers() if deployment.serves_adapters else {}
        workers.append({"name": deployment.name, "model": deployment.config.model_name,
                        "kind": deployment_kind(deployment.config), "state": _state(stats),
                        "figures": figures(stats),
                        "kv_cache_usage": kv if isinstance(kv, int | float) else None,
                        "adapters": sorted(tiers.items()),
                        "tenants": deployment.tenant_tokens()})
    if any(w["adapters"] or w["tenants"] for w in workers):
        names = {t.id: t.name for t in await tenants.list_tenants(session)}
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
