"""Budget counters start from recorded spend, so a restart never hands out a fresh budget."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission import period_start, tenant_budget
from tenancy import service
from tenancy.limits import Limiter


async def seed_budgets(
    sessionmaker: async_sessionmaker[AsyncSession], limiter: Limiter,
    *, now: datetime | None = None,
) -> int:
    """Seed every budgeted tenant's current-period counter; returns how many were seeded."""
    now = now or datetime.now(UTC)
    async with sessionmaker() as session:
        tenants = await service.budgeted_tenants(session)
        spent = {period: await service.spent_by_tenant(session, since=period_start(period, now))
                 for period in {p for _, _, p in tenants}}
    for tenant_id, cap, period in tenants:
        await limiter.seed_budget(tenant_budget(tenant_id, cap, period, now),
                                  spent[period].get(tenant_id, 0))
    return len(tenants)
