"""Budget counters and the usage ledger agree: counters start from the ledger's spend, so a
restart never hands out a fresh budget, and are raised to it periodically, so a counter that
lost increments (a Redis restart, a fail-open spell) catches up with what was billed."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.ledger import spent_by_tenant
from tenancy.limits import Budget, Limiter
from tenancy.plans import budgeted_tenants
from workers.periodic import Periodic

logger = logging.getLogger(__name__)


def tenant_budget(tenant_id: str, cap_micros: int, period: str,
                  now: datetime | None = None) -> Budget:
    """The budget counter of a tenant's current period (UTC calendar day or month)."""
    now = now or datetime.now(UTC)
    if period == "day":
        return Budget(f"tenant:{tenant_id}", cap_micros, now.strftime("%Y-%m-%d"), 2 * 86400)
    return Budget(f"tenant:{tenant_id}", cap_micros, now.strftime("%Y-%m"), 33 * 86400)


def period_start(period: str, now: datetime) -> datetime:
    start = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return start if period == "day" else start.replace(day=1)


async def ledger_spend(sessionmaker: async_sessionmaker[AsyncSession], now: datetime
                       ) -> list[tuple[str, int, str, int]]:
    """(tenant, cap, period, spent this period) for every budgeted tenant, from the daily
    aggregates: the same source invoices read."""
    async with sessionmaker() as session:
        tenants = await budgeted_tenants(session)
        spent = {period: await spent_by_tenant(session, since=period_start(period, now).date())
                 for period in {p for _, _, p in tenants}}
    return [(tenant, cap, period, spent[period].get(tenant, 0))
            for tenant, cap, period in tenants]


async def seed_budgets(
    sessionmaker: async_sessionmaker[AsyncSession], limiter: Limiter,
    *, now: datetime | None = None,
) -> int:
    """Seed every budgeted tenant's current-period counter; returns how many were seeded."""
    return await _apply(sessionmaker, limiter.seed_budget, now or datetime.now(UTC))


async def reconcile_budgets(
    sessionmaker: async_sessionmaker[AsyncSession], limiter: Limiter,
    *, now: datetime | None = None,
) -> int:
    """Raise every budgeted tenant's counter to its ledger spend; returns how many."""
    return await _apply(sessionmaker, limiter.reconcile_budget, now or datetime.now(UTC))


async def _apply(sessionmaker: async_sessionmaker[AsyncSession],
                 apply: Callable[[Budget, int], Awaitable[None]], now: datetime) -> int:
    rows = await ledger_spend(sessionmaker, now)
    for tenant_id, cap, period, spent in rows:
        await apply(tenant_budget(tenant_id, cap, period, now), spent)
    return len(rows)


class BudgetReconciler:
    """Runs `reconcile_budgets` every `interval_s` in the background."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], limiter: Limiter, *,
                 interval_s: float) -> None:
        self._sessionmaker = sessionmaker
        self._limiter = limiter
        self._loop = Periodic(self.reconcile, interval_s=interval_s, name="budget-reconciler",
                              survive=(SQLAlchemyError, OSError))

    async def reconcile(self) -> int:
        return await reconcile_budgets(self._sessionmaker, self._limiter)

    async def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
