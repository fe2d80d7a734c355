"""Admin keys: separate from tenant keys, for the admin API and console."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import AdminDep, SessionDep, StateDep
from gateway.errors import bad_request, not_found
from gateway.schemas.admin import AdminKeyCreate, AdminKeyCreated, AdminKeyOut, Id
from tenancy import admin_keys

router = APIRouter(prefix="/admin-keys", tags=["admin"])


@router.post("", status_code=201)
async def create_admin_key(
    body: AdminKeyCreate, session: SessionDep, state: StateDep
) -> AdminKeyCreated:
    record, full = await admin_keys.create_admin_key(session, pepper=state.keys.pepper,
                                                  name=body.name)
    await state.watcher.catch_up()
    out = AdminKeyOut.model_validate(record).model_dump()
    return AdminKeyCreated.model_validate({**out, "key": full})


@router.get("")
async def list_admin_keys(session: SessionDep) -> list[AdminKeyOut]:
    return [AdminKeyOut.model_validate(k) for k in await admin_keys.list_admin_keys(session)]


@router.delete("/{key_id}")
async def revoke_admin_key(
    key_id: Id, admin: AdminDep, session: SessionDep, state: StateDep
) -> AdminKeyOut:
    if key_id == admin.key_id:
        raise bad_request("An admin key cannot revoke itself; use another admin key.")
    key = await admin_keys.revoke_admin_key(session, key_id=key_id)
    if key is None:
        raise not_found(f"No admin key with id '{key_id}'.")
    await state.watcher.catch_up()
    return AdminKeyOut.model_validate(key)
