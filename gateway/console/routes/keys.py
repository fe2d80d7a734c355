"""A tenant's API keys: create with scopes, limits and expiry, revoke.

A new key's secret is in the answer to the create request only (an htmx fragment, so the
page's URL stays a GET and reloading it shows the key list without the secret); the server
keeps only its HMAC, as the admin API does.
"""

from __future__ import annotations

from fastapi import Request
from starlette.responses import RedirectResponse, Response

from gateway.console.auth import AdminSession, SignedIn
from gateway.console.forms import FormReader, error_text
from gateway.console.render import page
from gateway.console.routing import console_router
from gateway.deps import SessionDep, StateDep
from gateway.errors import APIError
from tenancy import api_keys, fields, tenants
from tenancy.errors import ServiceError

router = console_router()
SETTINGS = (*fields.KEY_LIMITS, fields.ALLOWED_MODELS, fields.ALLOWED_ADAPTERS)


@router.get("/tenants/{tenant_id}/keys")
async def keys_page(request: Request, tenant_id: str, admin: AdminSession,
                    session: SessionDep) -> Response:
    return await _page(request, admin, session, tenant_id)


@router.post("/tenants/{tenant_id}/keys")
async def create_key(request: Request, tenant_id: str, admin: AdminSession,
                     session: SessionDep, state: StateDep) -> Response:
    form = FormReader(await request.form())
    name = form.text("name", label="key name")
    expires_at = form.future_time("expires_at")
    settings = {field.name: form.setting(field) for field in SETTINGS}
    created: str | None = None
    if form.ok:
        try:
            _, created = await api_keys.create_api_key(
                session, tenant_id=tenant_id, pepper=state.keys.pepper, name=name,
                expires_at=expires_at, **settings)
        except (ServiceError, APIError) as exc:
            form.errors["_form"] = error_text(exc)
        else:
            await state.watcher.catch_up()  # usable on this replica at once
    return await _page(request, admin, session, tenant_id, form=None if created else form,
                       created=created, status_code=201 if created else 400)


@router.post("/tenants/{tenant_id}/keys/{key_id}/revoke")
async def revoke_key(request: Request, tenant_id: str, key_id: str, admin: AdminSession,
                     session: SessionDep, state: StateDep) -> Response:
    key = await api_keys.revoke_api_key(session, key_id=key_id, tenant_id=tenant_id)
    if key is not None:
        await state.watcher.catch_up()
    if request.headers.get("hx-request") != "true":
        return RedirectResponse(f"/console/tenants/{tenant_id}/keys", status_code=303)
    return await _page(request, admin, session, tenant_id,
                       status_code=200 if key is not None else 404,
                       notice=None if key is not None else f"No key '{key_id}' here.")


async def _page(request: Request, admin: SignedIn, session: SessionDep, tenant_id: str, *,
                form: FormReader | None = None, created: str | None = None,
                notice: str | None = None, status_code: int = 200) -> Response:
    tenant = await tenants.get_tenant(session, tenant_id=tenant_id)
    if tenant is None:
        return page(request, "error.html", {
            "admin": admin, "title": "Not found", "nav": "tenants",
            "message": f"No tenant with id '{tenant_id}'."}, status_code=404)
    keys = await api_keys.list_api_keys(session, tenant_id=tenant_id)
    return page(request, "keys.html", {
        "admin": admin, "title": f"{tenant.name}: API keys", "nav": "tenants",
        "tenant": tenant, "keys": keys, "form": form, "created": created, "notice": notice,
    }, fragment="_keys_panel.html", status_code=status_code)
