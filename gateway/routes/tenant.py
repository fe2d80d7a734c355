"""Tenant self-service: a key sees its own tenant's keys, nothing else (usage: routes/usage.py)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import SessionDep, StateDep, TenantDep
from gateway.errors import not_found
from gateway.schemas.admin import Id, KeyOut
from tenancy import api_keys

router = APIRouter(prefix="/v1", tags=["tenant"])


@router.get("/keys")
async def list_own_keys(key: TenantDep, session: SessionDep) -> list[KeyOut]:
    keys = await api_keys.list_api_keys(session, tenant_id=key.tenant_id)
    return [KeyOut.model_validate(k) for k in keys]


@router.delete("/keys/{key_id}")
async def revoke_own_key(
    key_id: Id, key: TenantDep, session: SessionDep, state: StateDep
) -> KeyOut:
    revoked = await api_keys.revoke_api_key(session, key_id=key_id, tenant_id=key.tenant_id)
    if revoked is None:
        raise not_found(f"No API key with id '{key_id}'.")
    await state.watcher.catch_up()  # here at once; other replicas within a poll
    return KeyOut.model_validate(revoked)
