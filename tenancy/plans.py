"""Plans: limits, allowed models and tiers, budget, cache and engine-share settings shared by
the tenants on them. Each setting is checked against its declaration in `tenancy.fields`.

Every function takes the session first and keyword-only arguments after it; mutations commit
themselves and bump the auth version (`tenancy.auth_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.auth_state import commit_mutation
from tenancy.context import PlanLimits
from tenancy.errors import ConflictError, InvalidError
from tenancy.fields import (
    BATCH_PRICE_PERCENT,
    BUDGET_PERIOD,
    CACHE_HIT_PRICE_PERCENT,
    CACHE_MODE,
    ENGINE_WEIGHT,
    PLAN_SETTINGS,
    PRICE_MARKUP_BP,
    PRIORITY,
    check_name,
)
from tenancy.models import Plan, Tenant


def _checked(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields as stored; InvalidError for an unknown field or a value out of bounds."""
    unknown = fields.keys() - PLAN_SETTINGS.keys() - {"name"}
    if unknown:
        raise InvalidError(f"unknown plan fields: {', '.join(sorted(unknown))}")
    return {field: check_name(value, "plan") if field == "name"
            else PLAN_SETTINGS[field].check(value) for field, value in fields.items()}


async def create_plan(
    session: AsyncSession,
    *,
    name: str,
    rpm: int | None = None,
    tpm: int | None = None,
    max_concurrent: int | None = None,
    budget_micros: int | None = None,
    budget_period: str = BUDGET_PERIOD.default,
    allowed_models: Sequence[str] | None = None,
    allowed_tiers: Sequence[str] | None = None,
    cache_mode: str = CACHE_MODE.default,
    semantic_threshold: float | None = None,
    cache_ttl_s: int | None = None,
    cache_hit_price_percent: int = CACHE_HIT_PRICE_PERCENT.default,
    price_markup_bp: int = PRICE_MARKUP_BP.default,
    engine_weight: float = ENGINE_WEIGHT.default,
    priority: int = PRIORITY.default,
    embedding_max_request_tokens: int | None = None,
    batch_price_percent: int = BATCH_PRICE_PERCENT.default,
) -> Plan:
    """Create a plan; ConflictError if the name is taken."""
    given = locals()  # the arguments, each a field of the plan but the session
    plan = Plan(**_checked({field: given[field] for field in ("name", *PLAN_SETTINGS)}))
    if await get_plan_by_name(session, name=plan.name) is not None:
        raise ConflictError(f"a plan named {plan.name!r} already exists")
    session.add(plan)
    await commit_mutation(session, f"plan {plan.name!r}")
    return plan


async def update_plan(session: AsyncSession, *, plan_id: str, **fields: Any) -> Plan | None:
    """Set the given fields (None clears a limit to unlimited); None if no such plan.

    Fields with a default (`cache_mode`, the price percents and markup, `engine_weight`,
    `priority`) cannot be None: they always have a value.
    """
    checked = _checked(fields)
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


async def budgeted_tenants(session: AsyncSession) -> list[tuple[str, int, str]]:
    """(tenant id, budget micro-USD, budget period) of every tenant whose plan has a budget."""
    rows = await session.execute(
        select(Tenant.id, Plan.budget_micros, Plan.budget_period)
        .join(Plan, Tenant.plan_id == Plan.id)
        .where(Plan.budget_micros.is_not(None))
    )
    return [(tenant_id, int(cap), period) for tenant_id, cap, period in rows]


def frozen(values: list[str] | None) -> frozenset[str] | None:
    """An allow-list as the auth snapshots hold it (None: everything)."""
    return None if values is None else frozenset(values)


def plan_limits(plan: Plan) -> PlanLimits:
    """The cacheable, immutable view of a plan."""
    return PlanLimits(
        rpm=plan.rpm,
        tpm=plan.tpm,
        max_concurrent=plan.max_concurrent,
        budget_micros=plan.budget_micros,
        budget_period=plan.budget_period,
        allowed_models=frozen(plan.allowed_models),
        allowed_tiers=frozen(plan.allowed_tiers),
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
