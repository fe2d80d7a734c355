"""Tenants: who is billed and limited together, on one plan; active or suspended, with an
optional semantic-cache threshold of their own.

Every function takes the session first and keyword-only arguments after it; mutations commit
themselves and bump the auth version (`tenancy.auth_state`).
"""

from __future__ import annotations

from enum import Enum
from typing import Final, Literal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.auth_state import commit_mutation
from tenancy.errors import ConflictError, NotFoundError
from tenancy.fields import SEMANTIC_THRESHOLD, TENANT_STATUS, check_name
from tenancy.models import Plan, Tenant


class Unset(Enum):
    """Marks an argument left out where None is a real value ("clear the override")."""

    UNSET = "unset"


UNSET: Final = Unset.UNSET


async def create_tenant(
    session: AsyncSession, *, name: str, plan_id: str, semantic_threshold: float | None = None
) -> Tenant:
    """Create an active tenant on a plan; NotFoundError for an unknown plan."""
    name = check_name(name, "tenant")
    semantic_threshold = SEMANTIC_THRESHOLD.check(semantic_threshold)
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
    if status is not None:
        TENANT_STATUS.check(status)
    if semantic_threshold is not UNSET:
        semantic_threshold = SEMANTIC_THRESHOLD.check(semantic_threshold)
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
