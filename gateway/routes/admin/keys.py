"""Tenant API keys: created (shown once), listed, revoked."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import SessionDep, StateDep
from gateway.errors import not_found
from gateway.schemas.admin import Id, KeyCreate, KeyCreated, KeyOut
from tenancy import api_keys, tenants

router = APIRouter(tags=["admin"])


@router.post("/tenants/{tenant_id}/keys", status_code=201)
async def create_key(
    tenant_id: Id, body: KeyCreate, session: SessionDep, state: StateDep
) -> KeyCreated:
    record, full = await api_keys.create_api_key(
        session, tenant_id=tenant_id, pepper=state.keys.pepper, **body.model_dump()
    )
    await state.watcher.catch_up()  # an id this replica had cached as unknown works at once
    return KeyCreated.model_validate({**KeyOut.model_validate(record).model_dump(), "key": full})


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: Id, session: SessionDep) -> list[KeyOut]:
    if await tenants.get_tenant(session, tenant_id=tenant_id) is None:
        raise not_found(f"No tenant with id '{tenant_id}'.")
    return [KeyOut.model_validate(k) for k in await api_keys.list_api_keys(session,
                                                                          tenant_id=tenant_id)]


@router.get("/keys/{key_id}")
async def get_key(key_id: Id, session: SessionDep) -> KeyOut:
    key = await api_keys.get_api_key(session, key_id=key_id)
    if key is None:
        raise not_found(f"No API key with id '{key_id}'.")
    return KeyOut.model_validate(key)


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: Id, session: SessionDep, state: StateDep) -> KeyOut:
    key = await api_keys.revoke_api_key(session, key_id=key_id)
    if key is None:
        raise not_found(f"No API key with id '{key_id}'.")
    await state.watcher.catch_up()
    return KeyOut.model_validate(key)
