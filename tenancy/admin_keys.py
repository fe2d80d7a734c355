"""Admin keys, separate from tenant keys, for the admin API and the console: created (the full
key returned once), counted, listed, revoked, and loaded as an auth snapshot.

Every function takes the session first and keyword-only arguments after it; mutations commit
themselves and bump the auth version (`tenancy.auth_state`).
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.api_keys import unused_key_id
from tenancy.auth_state import commit_mutation
from tenancy.context import AdminContext
from tenancy.fields import key_name
from tenancy.keys import hash_secret
from tenancy.models import AdminKey, utcnow


async def create_admin_key(
    session: AsyncSession, *, pepper: bytes, name: str
) -> tuple[AdminKey, str]:
    """Create an admin key; returns the record and the full key (shown only once)."""
    generated = await unused_key_id(session, AdminKey)
    record = AdminKey(
        id=generated.key_id,
        name=key_name(name),
        secret_hash=hash_secret(pepper, generated.secret),
    )
    session.add(record)
    await commit_mutation(session, f"admin key {record.id!r}")
    return record, generated.full


async def count_admin_keys(session: AsyncSession) -> int:
    """Unrevoked admin keys: zero means the gateway should bootstrap one."""
    count = await session.scalar(
        select(func.count()).select_from(AdminKey).where(AdminKey.revoked_at.is_(None))
    )
    return int(count or 0)


async def list_admin_keys(session: AsyncSession) -> list[AdminKey]:
    """All admin keys (revoked ones included), oldest first."""
    rows = await session.scalars(select(AdminKey).order_by(AdminKey.created_at, AdminKey.id))
    return list(rows)


async def revoke_admin_key(session: AsyncSession, *, key_id: str) -> AdminKey | None:
    """Revoke an admin key (idempotent); None if not found."""
    key = await session.get(AdminKey, key_id)
    if key is None or key.revoked_at is not None:
        return key
    key.revoked_at = utcnow()
    await commit_mutation(session, f"admin key {key_id!r}")
    return key


async def load_admin_context(session: AsyncSession, *, key_id: str) -> AdminContext | None:
    """An admin key as an immutable snapshot; None if no such key."""
    key = await session.get(AdminKey, key_id)
    if key is None:
        return None
    return AdminContext(
        key_id=key.id,
        name=key.name,
        secret_hash=key.secret_hash,
        revoked=key.revoked_at is not None,
    )
