"""Tenants: who is billed and limited together."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import SessionDep, StateDep
from gateway.errors import not_found
from gateway.schemas.admin import Id, TenantCreate, TenantOut, TenantUpdate
from tenancy import tenants

router = APIRouter(prefix="/tenants", tags=["admin"])


@router.post("", status_code=201)
async def create_tenant(body: TenantCreate, session: SessionDep) -> TenantOut:
    tenant = await tenants.create_tenant(session, name=body.name, plan_id=body.plan_id,
                                         semantic_threshold=body.semantic_threshold)
    return TenantOut.model_validate(tenant)


@router.get("")
async def list_tenants(session: SessionDep) -> list[TenantOut]:
    return [TenantOut.model_validate(t) for t in await tenants.list_tenants(session)]


@router.get("/{tenant_id}")
async def get_tenant(tenant_id: Id, session: SessionDep) -> TenantOut:
    tenant = await tenants.get_tenant(session, tenant_id=tenant_id)
    if tenant is None:
        raise not_found(f"No tenant with id '{tenant_id}'.")
    return TenantOut.model_validate(tenant)


@router.patch("/{tenant_id}")
async def update_tenant(
    tenant_id: Id, body: TenantUpdate, session: SessionDep, state: StateDep
) -> TenantOut:
    # Only the fields sent: an absent semantic_threshold is kept, an explicit null clears it.
    fields = body.model_dump(exclude_unset=True)
    tenant = await tenants.update_tenant(session, tenant_id=tenant_id, **fields)
    if tenant is None:
        raise not_found(f"No tenant with id '{tenant_id}'.")
    await state.watcher.catch_up()
    return TenantOut.model_validate(tenant)
