"""Tenant API keys: created (the full key returned once; only a keyed hash is stored), listed,
revoked; and the auth snapshot of a key, its tenant and its plan that the hot path caches.

Every function takes the session first and keyword-only arguments after it; mutations commit
themselves and bump the auth version (`tenancy.auth_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.auth_state import commit_mutation
from tenancy.context import KeyContext
from tenancy.errors import ConflictError, InvalidError, NotFoundError
from tenancy.fields import ALLOWED_ADAPTERS, ALLOWED_MODELS, MAX_CONCURRENT, RPM, TPM, key_name
from tenancy.keys import GeneratedKey, generate_key, hash_secret
from tenancy.models import AdminKey, ApiKey, Plan, Tenant, utcnow
from tenancy.plans import frozen, plan_limits

_KEY_ID_ATTEMPTS = 5


async def unused_key_id(
    session: AsyncSession, model: type[ApiKey] | type[AdminKey]
) -> GeneratedKey:
    """A new key whose id no row of `model` has yet."""
    for _ in range(_KEY_ID_ATTEMPTS):
        key = generate_key(admin=model is AdminKey)
        if await session.get(model, key.key_id) is None:
            return key
    raise ConflictError("could not allocate a unique key id")  # pragma: no cover


async def create_api_key(
    session: AsyncSession,
    *,
    tenant_id: str,
    pepper: bytes,
    name: str = "",
    expires_at: datetime | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrent: int | None = None,
    allowed_models: Sequence[str] | None = None,
    allowed_adapters: Sequence[str] | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for a tenant; returns the record and the full key (shown only once)."""
    if await session.get(Tenant, tenant_id) is None:
        raise NotFoundError(f"no tenant with id {tenant_id!r}")
    if expires_at is not None and expires_at.tzinfo is None:
        raise InvalidError("expires_at must be timezone-aware")
    generated = await unused_key_id(session, ApiKey)
    record = ApiKey(
        id=generated.key_id,
        tenant_id=tenant_id,
        name=key_name(name),
        secret_hash=hash_secret(pepper, generated.secret),
        expires_at=expires_at,
        rpm=RPM.check(rpm),
        tpm=TPM.check(tpm),
        max_concurrent=MAX_CONCURRENT.check(max_concurrent),
        allowed_models=ALLOWED_MODELS.check(allowed_models),
        allowed_adapters=ALLOWED_ADAPTERS.check(allowed_adapters),
    )
    session.add(record)
    await commit_mutation(session, f"key {record.id!r}")
    return record, generated.full


async def list_api_keys(session: AsyncSession, *, tenant_id: str) -> list[ApiKey]:
    """The tenant's keys (revoked ones included), oldest first."""
    rows = await session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.id)
    )
    return list(rows)


async def get_api_key(
    session: AsyncSession, *, key_id: str, tenant_id: str | None = None
) -> ApiKey | None:
    """The key, or None; with `tenant_id`, another tenant's key is None too."""
    query = select(ApiKey).where(ApiKey.id == key_id)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return await session.scalar(query)


async def revoke_api_key(
    session: AsyncSession, *, key_id: str, tenant_id: str | None = None
) -> ApiKey | None:
    """Revoke a key (idempotent); scoped like `get_api_key`. None if not found."""
    key = await get_api_key(session, key_id=key_id, tenant_id=tenant_id)
    if key is None or key.revoked_at is not None:
        return key
    key.revoked_at = utcnow()
    await commit_mutation(session, f"key {key_id!r}")
    return key


async def load_key_context(session: AsyncSession, *, key_id: str) -> KeyContext | None:
    """Key, tenant and plan in one query, as an immutable snapshot; None if no such key."""
    row = (
        await session.execute(
            select(ApiKey, Tenant, Plan)
            .join(Tenant, ApiKey.tenant_id == Tenant.id)
            .join(Plan, Tenant.plan_id == Plan.id)
            .where(ApiKey.id == key_id)
        )
    ).first()
    if row is None:
        return None
    key, tenant, plan = row
    return KeyContext(
        key_id=key.id,
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        secret_hash=key.secret_hash,
        expires_at=None if key.expires_at is None else key.expires_at.timestamp(),
        revoked=key.revoked_at is not None,
        tenant_active=tenant.status == "active",
        plan=plan_limits(plan),
        rpm=key.rpm,
        tpm=key.tpm,
        max_concurrent=key.max_concurrent,
        allowed_models=frozen(key.allowed_models),
        allowed_adapters=frozen(key.allowed_adapters),
        tenant_semantic_threshold=tenant.semantic_threshold,
    )
