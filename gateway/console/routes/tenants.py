"""Tenants: list and search, create, move to another plan, edit the plan's limits, budget,
allowed models and tiers and engine share, suspend and reactivate. All through the data
functions of `tenancy.plans` and `tenancy.tenants`; every setting's bounds and hints come from
`tenancy.fields`."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.responses import RedirectResponse, Response

from gateway.console.auth import AdminSession, SignedIn
from gateway.console.forms import FormReader, error_text
from gateway.console.render import names, page, usd_input
from gateway.console.routing import console_router
from gateway.deps import SessionDep, StateDep
from gateway.errors import APIError
from tenancy import fields, plans, tenants
from tenancy.errors import ServiceError
from tenancy.models import Plan

router = console_router()
NEW_PLAN = "__new__"  # the create form's "a new plan named after the tenant"
# What the limits form edits of the tenant's plan (besides its budget, typed in dollars).
LIMITS = (fields.RPM, fields.TPM, fields.MAX_CONCURRENT, fields.BUDGET_PERIOD,
          fields.ALLOWED_MODELS, fields.ALLOWED_TIERS, fields.ENGINE_WEIGHT, fields.PRIORITY)


@router.get("/tenants")
async def tenants_page(request: Request, admin: AdminSession, session: SessionDep,
                       q: str = "") -> Response:
    return await _list_page(request, admin, session, q=q, form=None)


@router.post("/tenants")
async def create_tenant(request: Request, admin: AdminSession, session: SessionDep,
                        state: StateDep) -> Response:
    form = FormReader(await request.form())
    name = form.text("name", required=True, label="tenant name")
    plan_id = form.text("plan_id", required=True, max_len=64, label="plan")
    if form.ok:
        try:
            if plan_id == NEW_PLAN:
                plan_id = (await plans.create_plan(session, name=f"{name}-plan")).id
            tenant = await tenants.create_tenant(session, name=name, plan_id=plan_id)
        except (ServiceError, APIError) as exc:
            form.errors["_form"] = error_text(exc)
        else:
            await state.watcher.catch_up()
            return RedirectResponse(f"/console/tenants/{tenant.id}", status_code=303)
    return await _list_page(request, admin, session, q="", form=form, status_code=400)


@router.get("/tenants/{tenant_id}")
async def tenant_page(request: Request, tenant_id: str, admin: AdminSession,
                      session: SessionDep) -> Response:
    return await _detail_page(request, admin, session, tenant_id)


@router.post("/tenants/{tenant_id}/status")
async def set_status(request: Request, tenant_id: str, admin: AdminSession,
                     session: SessionDep, state: StateDep) -> Response:
    form = FormReader(await request.form())
    status = form.choice(fields.TENANT_STATUS)
    return await _update(request, admin, session, state, tenant_id, form, status=status)


@router.post("/tenants/{tenant_id}/plan")
async def move_plan(request: Request, tenant_id: str, admin: AdminSession,
                    session: SessionDep, state: StateDep) -> Response:
    form = FormReader(await request.form())
    plan_id = form.text("plan_id", required=True, max_len=64, label="plan")
    return await _update(request, admin, session, state, tenant_id, form, plan_id=plan_id)


@router.post("/tenants/{tenant_id}/limits")
async def edit_limits(request: Request, tenant_id: str, admin: AdminSession,
                      session: SessionDep, state: StateDep) -> Response:
    """Edits the tenant's plan (every tenant on it sees the change)."""
    form = FormReader(await request.form())
    # Blank is "unlimited" for a limit, the default for the plan's share and priority.
    changes: dict[str, Any] = {field.name: form.setting(field) for field in LIMITS}
    changes["budget_micros"] = form.dollars("budget_usd")
    tenant = await tenants.get_tenant(session, tenant_id=tenant_id)
    if tenant is None:
        return _missing(request, admin, tenant_id)
    if form.ok:
        try:
            await plans.update_plan(session, plan_id=tenant.plan_id, **changes)
        except (ServiceError, APIError) as exc:
            form.errors["_form"] = error_text(exc)
        else:
            await state.watcher.catch_up()
            return RedirectResponse(f"/console/tenants/{tenant_id}?saved=limits",
                                    status_code=303)
    return await _detail_page(request, admin, session, tenant_id, limits_form=form,
                              status_code=400)


async def _update(request: Request, admin: SignedIn, session: SessionDep, state: StateDep,
                  tenant_id: str, form: FormReader, **changes: Any) -> Response:
    if form.ok:
        try:
            tenant = await tenants.update_tenant(session, tenant_id=tenant_id, **changes)
        except (ServiceError, APIError) as exc:
            form.errors["_form"] = error_text(exc)
        else:
            if tenant is None:
                return _missing(request, admin, tenant_id)
            await state.watcher.catch_up()
            return RedirectResponse(f"/console/tenants/{tenant_id}?saved=1", status_code=303)
    return await _detail_page(request, admin, session, tenant_id, tenant_form=form,
                              status_code=400)


async def _list_page(request: Request, admin: SignedIn, session: SessionDep, *, q: str,
                     form: FormReader | None, status_code: int = 200) -> Response:
    listed = await tenants.list_tenants(session)
    all_plans = await plans.list_plans(session)
    needle = q.strip().lower()
    if needle:
        listed = [t for t in listed if needle in t.name.lower() or needle in t.id]
    return page(request, "tenants.html", {
        "admin": admin, "title": "Tenants", "nav": "tenants", "tenants": listed, "q": q,
        "plans": all_plans, "plan_names": {p.id: p.name for p in all_plans},
        "new_plan": NEW_PLAN,
        "form": form}, fragment="_tenants_table.html", status_code=status_code)


async def _detail_page(request: Request, admin: SignedIn, session: SessionDep, tenant_id: str,
                       *, tenant_form: FormReader | None = None,
                       limits_form: FormReader | None = None, status_code: int = 200
                       ) -> Response:
    tenant = await tenants.get_tenant(session, tenant_id=tenant_id)
    if tenant is None:
        return _missing(request, admin, tenant_id)
    all_plans = await plans.list_plans(session)
    plan = next((p for p in all_plans if p.id == tenant.plan_id), None)
    return page(request, "tenant.html", {
        "admin": admin, "title": tenant.name, "nav": "tenants", "tenant": tenant,
        "plan": plan, "plans": all_plans, "tenant_form": tenant_form,
        "limits_form": limits_form, "limits": _limits_values(plan, limits_form),
        "saved": request.query_params.get("saved"), "fields": fields,
        "periods": [(period, period) for period in fields.BUDGET_PERIOD.options],
    }, status_code=status_code)


def _limits_values(plan: Plan | None, form: FormReader | None) -> dict[str, str]:
    """The limits form's fields: as typed after an error, else from the plan."""
    if form is not None:
        return form.values()
    if plan is None:
        return {}
    return {"rpm": _text(plan.rpm), "tpm": _text(plan.tpm),
            "max_concurrent": _text(plan.max_concurrent),
            "budget_usd": usd_input(plan.budget_micros), "budget_period": plan.budget_period,
            "allowed_models": names(plan.allowed_models),
            "allowed_tiers": names(plan.allowed_tiers),
            "engine_weight": str(plan.engine_weight).removesuffix(".0"),
            "priority": str(plan.priority)}


def _text(value: int | None) -> str:
    return "" if value is None else str(value)


def _missing(request: Request, admin: SignedIn, tenant_id: str) -> Response:
    return page(request, "error.html", {
        "admin": admin, "title": "Not found", "nav": "tenants",
        "message": f"No tenant with id '{tenant_id}'."}, status_code=404)
