"""Dashboards' numbers: requests, tokens, cost, cache-hit and error rates, grouped by day,
tenant, model, tier, deployment or adapter.

Read only from the daily aggregates (`usage_daily`), never from the raw records, so a report
over a year costs the same whether it covers a thousand requests or a billion. The price of
that is day granularity: bounds are whole UTC days.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.models import UsageDaily
from billing.money import usd


async def one_snapshot(session: AsyncSession) -> None:
    """Make the session's next reads one consistent view: a page or report built from several
    summaries must not mix a usage batch half seen. Call it first, before the session reads.

    PostgreSQL reads each statement afresh under READ COMMITTED, so the transaction asks for
    REPEATABLE READ. Python's sqlite3 opens no transaction for a SELECT (each read is its own
    snapshot), so on SQLite the read transaction is begun explicitly; WAL keeps its snapshot
    until the session ends."""
    dialect = session.bind.dialect.name
    if dialect == "postgresql":
        await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    elif dialect == "sqlite":
        connection = await session.connection()
        raw = await connection.get_raw_connection()
        if not raw.driver_connection.in_transaction:
            await connection.exec_driver_sql("BEGIN")


# Grouping dimensions, by the name callers use.
DIMENSIONS: dict[str, Any] = {
    "day": UsageDaily.day,
    "tenant": UsageDaily.tenant_id,
    "model": UsageDaily.model,
    "tier": UsageDaily.tier,
    "deployment": UsageDaily.deployment,
    "adapter": UsageDaily.adapter,
}
# What a tenant may group its own usage by (no tenants, no upstream deployment names).
TENANT_DIMENSIONS = ("day", "model", "tier", "adapter")
RATE_DIGITS = 6


@dataclass(frozen=True, slots=True)
class Metrics:
    """Sums over some usage; money in integer micro-USD."""

    requests: int = 0
    errors: int = 0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    input_cost_micros: int = 0
    cached_cost_micros: int = 0
    output_cost_micros: int = 0
    cost_micros: int = 0

    def __add__(self, other: Metrics) -> Metrics:
        return Metrics(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def cache_hit_rate(self) -> float:
        """Share of requests answered from the response cache."""
        return round(self.cache_hits / self.requests, RATE_DIGITS) if self.requests else 0.0

    @property
    def error_rate(self) -> float:
        """Share of requests that did not end "ok" (errors and aborts)."""
        return round(self.errors / self.requests, RATE_DIGITS) if self.requests else 0.0


METRIC_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Metrics))


@dataclass(frozen=True, slots=True)
class ReportRow:
    group: dict[str, str]  # dimension -> value (days as YYYY-MM-DD)
    metrics: Metrics


@dataclass(frozen=True, slots=True)
class Report:
    since: date | None
    until: date | None  # exclusive
    group_by: tuple[str, ...]
    rows: list[ReportRow]
    totals: Metrics


def day_bounds(since: datetime | date | None, until: datetime | date | None
               ) -> tuple[date | None, date | None]:
    """Whole UTC days [since, until) covering the asked period: `since` rounds down to its
    day, `until` up to the next midnight (unless it is one). Naive datetimes are UTC."""
    first = _utc_day(since) if since is not None else None
    last: date | None = None
    if until is not None:
        last = _utc_day(until)
        if isinstance(until, datetime) and _as_utc(until).time() != datetime.min.time():
            try:
                last = last + timedelta(days=1)
            except OverflowError:
                last = None  # past the calendar's end: unbounded
    return first, last


def parse_group_by(value: str, *, allowed: Sequence[str] = tuple(DIMENSIONS)
                   ) -> tuple[str, ...]:
    """"day,model" -> ("day", "model"); ValueError names what is not allowed."""
    names = tuple(dict.fromkeys(part.strip() for part in value.split(",") if part.strip()))
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"group_by takes a comma-separated list of {', '.join(allowed)}")
    return names


def filters(*, tenant_id: str | None = None, since: date | None = None,
            until: date | None = None, model: str | None = None, tier: str | None = None,
            ) -> list[ColumnElement[bool]]:
    """WHERE clauses on the aggregates: days in [since, until)."""
    clauses: list[ColumnElement[bool]] = []
    if tenant_id is not None:
        clauses.append(UsageDaily.tenant_id == tenant_id)
    if since is not None:
        clauses.append(UsageDaily.day >= since)
    if until is not None:
        clauses.append(UsageDaily.day < until)
    if model is not None:
        clauses.append(UsageDaily.model == model)
    if tier is not None:
        clauses.append(UsageDaily.tier == tier)
    return clauses


async def grouped(session: AsyncSession, *, group_by: Sequence[str],
                  where: Sequence[ColumnElement[bool]]) -> list[ReportRow]:
    """Sums of the aggregates per group, ordered by the group's values."""
    dims = [DIMENSIONS[name].label(name) for name in group_by]
    sums = [func.coalesce(func.sum(getattr(UsageDaily, m)), 0) for m in METRIC_NAMES]
    query = select(*dims, *sums).where(*where)
    if dims:
        query = query.group_by(*dims).order_by(*dims)
    rows = []
    for row in await session.execute(query):
        group = {name: _text(value) for name, value in zip(group_by, row, strict=False)}
        metrics = Metrics(*(int(v) for v in row[len(dims):]))
        if dims or metrics.requests:
            rows.append(ReportRow(group, metrics))
    return rows


async def summarize(session: AsyncSession, *, tenant_id: str | None = None,
                    since: date | None = None, until: date | None = None,
                    group_by: Sequence[str] = ("day",), model: str | None = None,
                    tier: str | None = None) -> Report:
    """Usage in whole UTC days [since, until), grouped; totals are the sum of the rows."""
    rows = await grouped(session, group_by=group_by, where=filters(
        tenant_id=tenant_id, since=since, until=until, model=model, tier=tier))
    totals = sum((r.metrics for r in rows), Metrics())
    return Report(since, until, tuple(group_by), rows, totals)


def metrics_dict(metrics: Metrics) -> dict[str, Any]:
    """JSON-ready metrics with the rates and `cost_usd`."""
    out: dict[str, Any] = {name: getattr(metrics, name) for name in METRIC_NAMES}
    out["cost_usd"] = usd(metrics.cost_micros)
    out["cache_hit_rate"] = metrics.cache_hit_rate
    out["error_rate"] = metrics.error_rate
    return out


def _as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _utc_day(value: datetime | date) -> date:
    return _as_utc(value).date() if isinstance(value, datetime) else value


def _text(value: Any) -> str:
    return value.isoformat() if isinstance(value, date) else str(value)
