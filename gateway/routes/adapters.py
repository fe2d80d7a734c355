"""Tenant self-service adapters under /v1/adapters: upload, list, load, unload, delete.

Always the caller's own tenant: another tenant's adapter answers exactly like a name nobody
registered. Tenants upload files and never name a server folder (only admins may), and
pinning is left to admins because device slots are shared by every tenant.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query

from gateway.adapters import manage
from gateway.deps import SessionDep, StateDep, TenantDep
from gateway.errors import bad_request, forbidden, not_found
from gateway.schemas.adapters import AdapterKey, AdapterOut, AdapterUpload
from gateway.state import GatewayState
from tenancy import adapters as rows
from tenancy.context import KeyContext
from tenancy.models import Adapter

router = APIRouter(prefix="/v1/adapters", tags=["tenant"])
UPLOAD_PATH = "/v1/adapters/upload"  # authenticated before its body is read (middleware)
WaitS = Annotated[float, Query(ge=0, le=600)]


@router.post("/upload", status_code=201)
async def upload_adapter(
    form: Annotated[AdapterUpload, Form()], key: TenantDep, session: SessionDep, state: StateDep
) -> AdapterOut:
    _check_scope(key, form.name)
    if not key.may_use_model(form.base_model):
        raise forbidden(f"Your API key is not allowed to use the model '{form.base_model}'.",
                        code="model_not_allowed")
    limit = state.settings.max_adapters_per_tenant
    if await rows.count_adapters(session, tenant_id=key.tenant_id) >= limit:
        raise bad_request(f"A tenant may have at most {limit} adapters; delete one first.",
                          code="too_many_adapters")
    adapter = await manage.register_upload(
        state, session, tenant_id=key.tenant_id, name=form.name, base_model=form.base_model,
        alias=form.alias, config_file=form.adapter_config.file,
        weights_file=form.adapter_model.file)
    return await _out(state, adapter)


@router.get("")
async def list_own_adapters(key: TenantDep, session: SessionDep, state: StateDep
                            ) -> list[AdapterOut]:
    """The tenant's adapters this key may use."""
    adapters = [a for a in await rows.list_adapters(session, tenant_id=key.tenant_id)
                if key.may_use_adapter(a.name)]
    residency = await manage.residencies(state, adapters)
    return [AdapterOut.model_validate(manage.describe(a, residency[a.id])) for a in adapters]


@router.post("/{name}/load")
async def load_own_adapter(name: AdapterKey, key: TenantDep, session: SessionDep,
                           state: StateDep) -> AdapterOut:
    adapter = await _own(session, key, name)
    adapter = await manage.load(state, session, adapter, show_path=False)
    return await _out(state, adapter)


@router.post("/{name}/unload")
async def unload_own_adapter(name: AdapterKey, key: TenantDep, session: SessionDep,
                             state: StateDep, wait_s: WaitS = 0.0) -> AdapterOut:
    adapter = await _own(session, key, name)
    await manage.unload(state, adapter, wait_s=wait_s)
    return await _out(state, adapter)


@router.delete("/{name}")
async def delete_own_adapter(name: AdapterKey, key: TenantDep, session: SessionDep,
                             state: StateDep, wait_s: WaitS = 0.0) -> AdapterOut:
    adapter = await _own(session, key, name)
    deleted = await manage.delete(state, session, adapter, wait_s=wait_s)
    return AdapterOut.model_validate(manage.describe(deleted, "unloaded"))


async def _out(state: GatewayState, adapter: Adapter) -> AdapterOut:
    residency = await manage.residencies(state, [adapter])
    return AdapterOut.model_validate(manage.describe(adapter, residency[adapter.id]))


async def _own(session: SessionDep, key: KeyContext, name: str) -> Adapter:
    """The caller's tenant's adapter; anyone else's is as missing as a name never used."""
    adapter = await rows.get_adapter(session, tenant_id=key.tenant_id, name=name)
    if adapter is None:
        raise not_found(f"The adapter '{name}' does not exist or you do not have access to it.",
                        code="model_not_found", param="name")
    _check_scope(key, name)
    return adapter


def _check_scope(key: KeyContext, name: str) -> None:
    if not key.may_use_adapter(name):
        raise forbidden(f"Your API key is not allowed to use the adapter '{name}'.",
                        code="adapter_not_allowed")
