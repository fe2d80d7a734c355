"""Data functions for plans, tenants, keys, admin keys and usage.

Every function takes the session first and keyword-only arguments after it. Mutations commit
themselves and bump `AuthState.version` in the same transaction, so replicas polling the
version drop their key caches as soon as the change is visible.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from enum import Enum
from math import isfinite
from typing import Any, Final, Literal

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.context import AdminContext, KeyContext, PlanLimits
from tenancy.keys import GeneratedKey, generate_key, hash_secret
from tenancy.models import (
    AUTH_STATE_ID,
    BUDGET_PERIODS,
    CACHE_MODES,
    TENANT_STATUSES,
    AdminKey,
    ApiKey,
    AuthState,
    Plan,
    Tenant,
    utcnow,
)

_PLAN_FIELDS = frozenset(
    {
        "name",
        "rpm",
        "tpm",
        "max_concurrent",
        "budget_micros",
        "budget_period",
        "allowed_models",
        "allowed_tiers",
        "cache_mode",
        "semantic_threshold",
        "cache_ttl_s",
        "cache_hit_price_percent",
        "price_markup_bp",
        "engine_weight",
        "priority",
        "embedding_max_request_tokens",
        "batch_price_percent",
    }
)
_KEY_ID_ATTEMPTS = 5
_INT32_MAX = 2**31 - 1


class Unset(Enum):
    """Marks an argument left out where None is a real value ("clear the override")."""

    UNSET = "unset"


UNSET: Final = Unset.UNSET


class ServiceError(Exception):
    """Base of the errors the HTTP layer and the CLI turn into client-facing messages."""


class ConflictError(ServiceError):
    """The change clashes with existing data (a duplicate name). HTTP 409."""


class NotFoundError(ServiceError):
    """A referenced plan, tenant or key does not exist. HTTP 404."""


class InvalidError(ServiceError, ValueError):
    """A value is out of range or not one of the allowed choices. HTTP 400."""


# --- auth version -------------------------------------------------------------------------


async def auth_version(session: AsyncSession) -> int:
    """The current auth version (0 before the first mutation)."""
    version = await session.scalar(select(AuthState.version).where(AuthState.id == AUTH_STATE_ID))
    return int(version or 0)


async def _bump_auth_version(session: AsyncSession) -> None:
    result = await session.execute(
        update(AuthState)
        .where(AuthState.id == AUTH_STATE_ID)
        .values(version=AuthState.version + 1)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 0:  # tables made without the migration's seed row
        session.add(AuthState(id=AUTH_STATE_ID, version=1))


async def commit_mutation(session: AsyncSession, what: str) -> None:
    """Bump the version and commit; a unique/foreign-key violation becomes ConflictError."""
    try:
        await session.flush()  # constraint violations surface here, before the bump
        await _bump_auth_version(session)
        await session.commit()
    except IntegrityError as exc:
        await session.rollback()
        raise ConflictError(f"{what} conflicts with existing data") from exc


# --- validation ---------------------------------------------------------------------------


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidError(f"{what} name must be a non-empty string")
    name = name.strip()
    if len(name) > 200:
        raise InvalidError(f"{what} name is longer than 200 characters")
    return name


def _check_limit(value: int | None, field: str) -> int | None:
    """Limits fit a 32-bit column; money (micro-USD) fits a 64-bit one."""
    if value is None:
        return None
    top = 2**63 - 1 if field.endswith("_micros") else 2**31 - 1
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise InvalidError(f"{field} must be an integer in [0, {top}] or null")
    return value


def _check_names(values: Iterable[str] | None, field: str) -> list[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        raise InvalidError(f"{field} must be a list of names, not a string")
    out: list[str] = []
    for value in values:
        if not isinstance(value, str) or not value:
            raise InvalidError(f"{field} must contain non-empty strings")
        if value not in out:
            out.append(value)
    return out


def _check_period(value: str) -> str:
    if value not in BUDGET_PERIODS:
        raise InvalidError(f"budget_period must be one of {', '.join(BUDGET_PERIODS)}")
    return value


def _check_cache_mode(value: str) -> str:
    if value not in CACHE_MODES:
        raise InvalidError(f"cache_mode must be one of {', '.join(CACHE_MODES)}")
    return value


def check_semantic_threshold(value: float | None) -> float | None:
    """A cosine similarity in (0, 1] (1: identical prompts only), or None for the default."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not isfinite(value)
        or not 0 < value <= 1
    ):
        raise InvalidError("semantic_threshold must be a number in (0, 1] or null")
    return float(value)


def _check_engine_weight(value: float) -> float:
    """A finite share in (0, 100]: zero would never schedule the tenant, and the cap keeps
    any one tenant within 100 times the default weight of 1."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not isfinite(value)
        or not 0 < value <= 100
    ):
        raise InvalidError("engine_weight must be a finite number in (0, 100]")
    return float(value)


def _check_bounded(value: int | None, field: str, *, low: int, high: int, nullable: bool) -> Any:
    """An integer in [low, high]; None only where the column is nullable."""
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        suffix = " or null" if nullable else ""
        raise InvalidError(f"{field} must be an integer in [{low}, {high}]{suffix}")
    return value


def _check_plan_field(field: str, value: Any) -> Any:
    if field == "name":
        return check_name(value, "plan")
    if field == "budget_period":
        return _check_period(value)
    if field == "cache_mode":
        return _check_cache_mode(value)
    if field == "semantic_threshold":
        return check_semantic_threshold(value)
    if field == "cache_ttl_s":
        return _check_bounded(value, field, low=1, high=_INT32_MAX, nullable=True)
    if field in ("cache_hit_price_percent", "batch_price_percent"):
        return _check_bounded(value, field, low=0, high=100, nullable=False)
    if field == "price_markup_bp":  # from free (-100%) to ten times the price
        return _check_bounded(value, field, low=-10_000, high=100_000, nullable=False)
    if field == "engine_weight":
        return _check_engine_weight(value)
    if field == "priority":  # lower runs first
        return _check_bounded(value, field, low=-10, high=10, nullable=False)
    if field == "embedding_max_request_tokens":  # 0 would refuse every request
        return _check_bounded(value, field, low=1, high=_INT32_MAX, nullable=True)
    if field in ("allowed_models", "allowed_tiers"):
        return _check_names(value, field)
    return _check_limit(value, field)


# --- plans --------------------------------------------------------------------------------


async def create_plan(
    session: AsyncSession,
    *,
    name: str,
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrent: int | None = None,
    budget_micros: int | None = None,
    budget_period: str = "month",
    allowed_models: Sequence[str] | None = None,
    allowed_tiers: Sequence[str] | None = None,
    cache_mode: str = "auto",
    semantic_threshold: float | None = None,
    cache_ttl_s: int | None = None,
    cache_hit_price_percent: int = 0,
    price_markup_bp: int = 0,
    engine_weight: float = 1.0,
    priority: int = 0,
    embedding_max_request_tokens: int | None = None,
    batch_price_percent: int = 50,
) -> Plan:
    """Create a plan; ConflictError if the name is taken."""
    fields = {
        "name": name,
        "rpm": rpm,
        "tpm": tpm,
        "max_concurrent": max_concurrent,
        "budget_micros": budget_micros,
        "budget_period": budget_period,
        "allowed_models": allowed_models,
        "allowed_tiers": allowed_tiers,
        "cache_mode": cache_mode,
        "semantic_threshold": semantic_threshold,
        "cache_ttl_s": cache_ttl_s,
        "cache_hit_price_percent": cache_hit_price_percent,
        "price_markup_bp": price_markup_bp,
        "engine_weight": engine_weight,
        "priority": priority,
        "embedding_max_request_tokens": embedding_max_request_tokens,
        "batch_price_percent": batch_price_percent,
    }
    plan = Plan(**{field: _check_plan_field(field, value) for field, value in fields.items()})
    if await get_plan_by_name(session, name=plan.name) is not None:
        raise ConflictError(f"a plan named {plan.name!r} already exists")
    session.add(plan)
    await commit_mutation(session, f"plan {plan.name!r}")
    return plan


async def update_plan(session: AsyncSession, *, plan_id: str, **fields: Any) -> Plan | None:
    """Set the given fields (None clears a limit to unlimited); None if no such plan.

    `cache_mode`, `cache_hit_price_percent`, `batch_price_percent`, `price_markup_bp`,
    `engine_weight` and `priority` cannot be None: they always have a value.
    """
    unknown = set(fields) - _PLAN_FIELDS
    if unknown:
        raise InvalidError(f"unknown plan fields: {', '.join(sorted(unknown))}")
    checked = {field: _check_plan_field(field, value) for field, value in fields.items()}
    plan = await session.get(Plan, plan_id)
    if plan is None:
        return None
    new_name = checked.get("name")
    if new_name is not None and new_name != plan.name:
        other = await get_plan_by_name(session, name=new_name)
        if other is not None:
            raise ConflictError(f"a plan named {new_name!r} already exists")
    for field, value in checked.items():
        setattr(plan, field, value)
    await commit_mutation(session, f"plan {plan.name!r}")
    return plan


async def list_plans(session: AsyncSession) -> list[Plan]:
    """All plans, oldest first."""
    rows = await session.scalars(select(Plan).order_by(Plan.created_at, Plan.id))
    return list(rows)


async def get_plan(session: AsyncSession, *, plan_id: str) -> Plan | None:
    """The plan with this id, or None."""
    return await session.get(Plan, plan_id)


async def get_plan_by_name(session: AsyncSession, *, name: str) -> Plan | None:
    """The plan with this name, or None."""
    return await session.scalar(select(Plan).where(Plan.name == name))


# --- tenants ------------------------------------------------------------------------------


async def create_tenant(
    session: AsyncSession, *, name: str, plan_id: str, semantic_threshold: float | None = None
) -> Tenant:
    """Create an active tenant on a plan; NotFoundError for an unknown plan."""
    name = check_name(name, "tenant")
    semantic_threshold = check_semantic_threshold(semantic_threshold)
    if await session.get(Plan, plan_id) is None:
        raise NotFoundError(f"no plan with id {plan_id!r}")
    if await get_tenant_by_name(session, name=name) is not None:
        raise ConflictError(f"a tenant named {name!r} already exists")
    tenant = Tenant(
        name=name, plan_id=plan_id, status="active", semantic_threshold=semantic_threshold
    )
    session.add(tenant)
    await commit_mutation(session, f"tenant {name!r}")
    return tenant


async def list_tenants(session: AsyncSession) -> list[Tenant]:
    """All tenants, oldest first."""
    rows = await session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id))
    return list(rows)


async def get_tenant(session: AsyncSession, *, tenant_id: str) -> Tenant | None:
    """The tenant with this id, or None."""
    return await session.get(Tenant, tenant_id)


async def get_tenant_by_name(session: AsyncSession, *, name: str) -> Tenant | None:
    """The tenant with this name, or None."""
    return await session.scalar(select(Tenant).where(Tenant.name == name))


async def update_tenant(
    session: AsyncSession,
    *,
    tenant_id: str,
    plan_id: str | None = None,
    status: str | None = None,
    semantic_threshold: float | Literal[Unset.UNSET] | None = UNSET,
) -> Tenant | None:
    """Move a tenant to another plan, suspend or reactivate it, and/or set or clear (None) its
    semantic-cache threshold; None if no such tenant. Left-out arguments change nothing.
    """
    if status is not None and status not in TENANT_STATUSES:
        raise InvalidError(f"status must be one of {', '.join(TENANT_STATUSES)}")
    if semantic_threshold is not UNSET:
        semantic_threshold = check_semantic_threshold(semantic_threshold)
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        return None
    if plan_id is not None:
        if await session.get(Plan, plan_id) is None:
            raise NotFoundError(f"no plan with id {plan_id!r}")
        tenant.plan_id = plan_id
    if status is not None:
        tenant.status = status
    if semantic_threshold is not UNSET:
        tenant.semantic_threshold = semantic_threshold
    await commit_mutation(session, f"tenant {tenant.name!r}")
    return tenant


# --- tenant API keys ----------------------------------------------------------------------


async def _unused_key_id(
    session: AsyncSession, model: type[ApiKey] | type[AdminKey]
) -> GeneratedKey:
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
    generated = await _unused_key_id(session, ApiKey)
    record = ApiKey(
        id=generated.key_id,
        tenant_id=tenant_id,
        name=(name or "").strip()[:200],
        secret_hash=hash_secret(pepper, generated.secret),
        expires_at=expires_at,
        rpm=_check_limit(rpm, "rpm"),
        tpm=_check_limit(tpm, "tpm"),
        max_concurrent=_check_limit(max_concurrent, "max_concurrent"),
        allowed_models=_check_names(allowed_models, "allowed_models"),
        allowed_adapters=_check_names(allowed_adapters, "allowed_adapters"),
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


# --- admin keys ---------------------------------------------------------------------------


async def create_admin_key(
    session: AsyncSession, *, pepper: bytes, name: str
) -> tuple[AdminKey, str]:
    """Create an admin key; returns the record and the full key (shown only once)."""
    generated = await _unused_key_id(session, AdminKey)
    record = AdminKey(
        id=generated.key_id,
        name=(name or "").strip()[:200],
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


# --- auth snapshots -----------------------------------------------------------------------


def _frozen(values: list[str] | None) -> frozenset[str] | None:
    return None if values is None else frozenset(values)


def plan_limits(plan: Plan) -> PlanLimits:
    """The cacheable, immutable view of a plan."""
    return PlanLimits(
        rpm=plan.rpm,
        tpm=plan.tpm,
        max_concurrent=plan.max_concurrent,
        budget_micros=plan.budget_micros,
        budget_period=plan.budget_period,
        allowed_models=_frozen(plan.allowed_models),
        allowed_tiers=_frozen(plan.allowed_tiers),
        cache_mode=plan.cache_mode,
        semantic_threshold=plan.semantic_threshold,
        cache_ttl_s=plan.cache_ttl_s,
        cache_hit_price_percent=plan.cache_hit_price_percent,
        price_markup_bp=plan.price_markup_bp,
        engine_weight=plan.engine_weight,
        priority=plan.priority,
        embedding_max_request_tokens=plan.embedding_max_request_tokens,
        batch_price_percent=plan.batch_price_percent,
    )


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
        allowed_models=_frozen(key.allowed_models),
        allowed_adapters=_frozen(key.allowed_adapters),
        tenant_semantic_threshold=tenant.semantic_threshold,
    )


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


# --- usage --------------------------------------------------------------------------------


async def budgeted_tenants(session: AsyncSession) -> list[tuple[str, int, str]]:
    """(tenant id, budget micro-USD, budget period) of every tenant whose plan has a budget."""
    rows = await session.execute(
        select(Tenant.id, Plan.budget_micros, Plan.budget_period)
        .join(Plan, Tenant.plan_id == Plan.id)
        .where(Plan.budget_micros.is_not(None))
    )
    return [(tenant_id, int(cap), period) for tenant_id, cap, period in rows]
