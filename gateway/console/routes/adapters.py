"""A tenant's LoRA adapters: register a server folder or upload the two peft files, load,
unload, delete, and where each is resident. All through `gateway.adapters.manage`, the
functions the admin API calls."""

from __future__ import annotations

from fastapi import Request
from starlette.responses import RedirectResponse, Response

from gateway.adapters import manage
from gateway.console.auth import AdminSession, SignedIn
from gateway.console.forms import FormReader, error_text
from gateway.console.render import page
from gateway.console.routing import console_router
from gateway.deps import SessionDep, StateDep
from gateway.errors import APIError
from gateway.state import GatewayState
from tenancy import adapters as rows
from tenancy import tenants
from tenancy.errors import ServiceError

router = console_router()
ACTIONS = ("load", "unload", "delete")


@router.get("/tenants/{tenant_id}/adapters")
async def adapters_page(request: Request, tenant_id: str, admin: AdminSession,
                        session: SessionDep, state: StateDep) -> Response:
    return await _page(request, admin, session, state, tenant_id)


@router.post("/tenants/{tenant_id}/adapters")
async def register_path(request: Request, tenant_id: str, admin: AdminSession,
                        session: SessionDep, state: StateDep) -> Response:
    form = FormReader(await request.form())
    fields = _common(form)
    path = form.text("path", required=True, max_len=4096, label="folder")
    if form.ok and await _tenant_exists(session, tenant_id):
        try:
            await manage.register_path(state, session, tenant_id=tenant_id, path=path,
                                       **fields)
        except (ServiceError, APIError) as exc:
            form.errors["_form"] = error_text(exc)
        else:
            return _back(tenant_id)
    return await _page(request, admin, session, state, tenant_id, path_form=form,
                       status_code=400)


@router.post("/tenants/{tenant_id}/adapters/upload")
async def upload(request: Request, tenant_id: str, admin: AdminSession,
                 session: SessionDep, state: StateDep) -> Response:
    form = FormReader(await request.form())
    fields = _common(form)
    config_file = form.file("adapter_config")
    weights_file = form.file("adapter_model")
    if form.ok and config_file and weights_file and await _tenant_exists(session, tenant_id):
        try:
            await manage.register_upload(state, session, tenant_id=tenant_id,
                                         config_file=config_file.file,
                                         weights_file=weights_file.file, **fields)
        except (ServiceError, APIError) as exc:
            form.errors["_form"] = error_text(exc)
        else:
            return _back(tenant_id)
    return await _page(request, admin, session, state, tenant_id, upload_form=form,
                       status_code=400)


@router.post("/tenants/{tenant_id}/adapters/{name}/{action}")
async def act(request: Request, tenant_id: str, name: str, action: str, admin: AdminSession,
              session: SessionDep, state: StateDep) -> Response:
    adapter = await rows.get_adapter(session, tenant_id=tenant_id, name=name)
    if action not in ACTIONS or adapter is None:
        return await _page(request, admin, session, state, tenant_id, status_code=404,
                           notice=f"No adapter '{name}' (or no action '{action}') here.")
    try:
        if action == "load":
            await manage.load(state, session, adapter, show_path=True)
        elif action == "unload":
            await manage.unload(state, adapter)
        else:
            await manage.delete(state, session, adapter)
    except (ServiceError, APIError) as exc:
        return await _page(request, admin, session, state, tenant_id, status_code=400,
                           notice=error_text(exc))
    return _back(tenant_id)


def _common(form: FormReader) -> dict[str, str | bool | None]:
    return {"name": form.text("name", required=True, max_len=128, label="adapter name"),
            "base_model": form.text("base_model", required=True, max_len=512,
                                    label="base model"),
            "alias": form.text("alias", max_len=128) or None, "pinned": form.flag("pinned")}


async def _tenant_exists(session: SessionDep, tenant_id: str) -> bool:
    return await tenants.get_tenant(session, tenant_id=tenant_id) is not None


def _back(tenant_id: str) -> Response:
    return RedirectResponse(f"/console/tenants/{tenant_id}/adapters", status_code=303)


def _base_models(state: GatewayState) -> list[str]:
    """Models with a deployment that serves adapters: what an adapter can be trained on."""
    return sorted({d.config.model_name for d in state.deployments.deployments()
                   if d.serves_adapters})


async def _page(request: Request, admin: SignedIn, session: SessionDep, state: GatewayState,
                tenant_id: str, *, path_form: FormReader | None = None,
                upload_form: FormReader | None = None, notice: str | None = None,
                status_code: int = 200) -> Response:
    tenant = await tenants.get_tenant(session, tenant_id=tenant_id)
    if tenant is None:
        return page(request, "error.html", {
            "admin": admin, "title": "Not found", "nav": "tenants",
            "message": f"No tenant with id '{tenant_id}'."}, status_code=404)
    adapters = await rows.list_adapters(session, tenant_id=tenant_id)
    residency = await manage.residencies(state, adapters)
    return page(request, "adapters.html", {
        "admin": admin, "title": f"{tenant.name}: adapters", "nav": "tenants",
        "tenant": tenant, "adapters": [manage.describe(a, residency[a.id]) for a in adapters],
        "base_models": _base_models(state), "path_form": path_form,
        "upload_form": upload_form, "notice": notice}, status_code=status_code)
