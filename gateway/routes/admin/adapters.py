"""Tenants' LoRA adapters: register from a server folder or an upload, list with residency,
load, unload, delete. Only admins may make the server read a folder it names."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query

from gateway.adapters import manage
from gateway.deps import SessionDep, StateDep
from gateway.errors import not_found
from gateway.schemas.adapters import (
    AdapterCreate,
    AdapterKey,
    AdminAdapterOut,
    AdminAdapterUpload,
)
from gateway.schemas.admin import Id
from gateway.state import GatewayState
from tenancy import adapters as rows
from tenancy import tenants
from tenancy.models import Adapter

router = APIRouter(prefix="/tenants/{tenant_id}/adapters", tags=["admin"])
WaitS = Annotated[float, Query(ge=0, le=600)]


@router.post("", status_code=201)
async def register_adapter(
    tenant_id: Id, body: AdapterCreate, session: SessionDep, state: StateDep
) -> AdminAdapterOut:
    await _require_tenant(session, tenant_id)
    adapter = await manage.register_path(state, session, tenant_id=tenant_id,
                                         **body.model_dump())
    return await _out(state, adapter)


@router.post("/upload", status_code=201)
async def upload_adapter(
    tenant_id: Id, form: Annotated[AdminAdapterUpload, Form()], session: SessionDep,
    state: StateDep,
) -> AdminAdapterOut:
    await _require_tenant(session, tenant_id)
    adapter = await manage.register_upload(
        state, session, tenant_id=tenant_id, name=form.name, base_model=form.base_model,
        alias=form.alias, pinned=form.pinned, config_file=form.adapter_config.file,
        weights_file=form.adapter_model.file)
    return await _out(state, adapter)


@router.get("")
async def list_adapters(tenant_id: Id, session: SessionDep, state: StateDep
                        ) -> list[AdminAdapterOut]:
    await _require_tenant(session, tenant_id)
    adapters = await rows.list_adapters(session, tenant_id=tenant_id)
    residency = await manage.residencies(state, adapters)
    return [AdminAdapterOut.model_validate(manage.describe(a, residency[a.id]))
            for a in adapters]


@router.post("/{name}/load")
async def load_adapter(tenant_id: Id, name: AdapterKey, session: SessionDep, state: StateDep,
                       pinned: bool | None = None) -> AdminAdapterOut:
    adapter = await _require_adapter(session, tenant_id, name)
    adapter = await manage.load(state, session, adapter, pinned=pinned, show_path=True)
    return await _out(state, adapter)


@router.post("/{name}/unload")
async def unload_adapter(tenant_id: Id, name: AdapterKey, session: SessionDep, state: StateDep,
                         wait_s: WaitS = 0.0) -> AdminAdapterOut:
    adapter = await _require_adapter(session, tenant_id, name)
    await manage.unload(state, adapter, wait_s=wait_s)
    return await _out(state, adapter)


@router.delete("/{name}")
async def delete_adapter(tenant_id: Id, name: AdapterKey, session: SessionDep, state: StateDep,
                         wait_s: WaitS = 0.0) -> AdminAdapterOut:
    adapter = await _require_adapter(session, tenant_id, name)
    deleted = await manage.delete(state, session, adapter, wait_s=wait_s)
    return AdminAdapterOut.model_validate(manage.describe(deleted, "unloaded"))


async def _out(state: GatewayState, adapter: Adapter) -> AdminAdapterOut:
    residency = await manage.residencies(state, [adapter])
    return AdminAdapterOut.model_validate(manage.describe(adapter, residency[adapter.id]))


async def _require_tenant(session: SessionDep, tenant_id: str) -> None:
    if await tenants.get_tenant(session, tenant_id=tenant_id) is None:
        raise not_found(f"No tenant with id '{tenant_id}'.")


async def _require_adapter(session: SessionDep, tenant_id: str, name: str) -> Adapter:
    adapter = await rows.get_adapter(session, tenant_id=tenant_id, name=name)
    if adapter is None:
        raise not_found(f"Tenant '{tenant_id}' has no adapter named '{name}'.")
    return adapter
