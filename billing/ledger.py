"""Writing usage records, exactly once, with the daily aggregates in the same transaction.

The outbox may hand over a record twice (a replay after a crash): the record's request id is
unique, the second insert is skipped, and only records actually inserted are added to the
aggregates, so sums never double count.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from billing.models import UsageDaily
from tenancy.models import UsageRecord

AGGREGATE_KEY = ("tenant_id", "day", "model", "deployment", "tier", "adapter")
SUMS = ("requests", "errors", "cache_hits", "prompt_tokens", "completion_tokens",
        "cached_tokens", "input_cost_micros", "output_cost_micros", "cached_cost_micros",
        "cost_micros")
_DEFAULTS: dict[str, Any] = {
    "key_id": None, "deployment": "", "adapter": "", "tier": "", "prompt_tokens": 0,
    "completion_tokens": 0, "cached_tokens": 0, "cost_micros": 0, "input_cost_micros": 0,
    "output_cost_micros": 0, "cached_cost_micros": 0, "status": "ok", "cache_hit": "none",
    "price_id": None, "queue_ms": None, "ttft_ms": None, "total_ms": None, "started_at": None,
    "batch_id": None, "batch_price_percent": None,
}
_COLUMNS = frozenset(c.name for c in UsageRecord.__table__.columns) - {"id"}


async def write_batch(session: AsyncSession, *, records: Sequence[dict[str, Any]]) -> int:
    """Insert the records not yet stored and add them to the aggregates; commit. Returns how
    many were new."""
    rows = _rows(records)
    if not rows:
        return 0
    statements = _statements(session.get_bind().dialect.name)
    # SQLAlchemy Core on the tables, not ORM entities (the ORM bulk-insert path cost several
    # times the database's own work). Both are executemany with statements compiled once and
    # cached: the insert with RETURNING becomes multi-row INSERTs ("insertmanyvalues").
    conn = await session.connection()
    inserted = set((await conn.execute(statements[0], rows)).scalars())
    new = rows if len(inserted) == len(rows) else [
        row for row in rows if row["request_id"] in inserted]
    groups = aggregate(new)
    if groups:
        await conn.execute(statements[1], groups)
    await session.commit()
    return len(new)


def aggregate(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows summed per aggregate key (tenant, UTC day, model, deployment, tier, adapter)."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        day = row["created_at"].astimezone(UTC).date()
        key = (row["tenant_id"], day, row["model"], row["deployment"], row["tier"],
               row["adapter"])
        group = groups.get(key)
        if group is None:
            group = groups[key] = {**dict(zip(AGGREGATE_KEY, key, strict=True)),
                                   **dict.fromkeys(SUMS, 0)}
        group["requests"] += 1
        group["errors"] += row["status"] != "ok"
        group["cache_hits"] += row["cache_hit"] != "none"
        for name in SUMS[3:]:
            group[name] += int(row[name] or 0)
    return list(groups.values())


def spent_query(*, since: date, until: date | None = None) -> Select[tuple[str, int]]:
    """Spend per tenant over whole UTC days [since, until), from the aggregates: what budgets
    start from and are reconciled with."""
    query = (select(UsageDaily.tenant_id, func.coalesce(func.sum(UsageDaily.cost_micros), 0))
             .where(UsageDaily.day >= since).group_by(UsageDaily.tenant_id))
    if until is not None:
        query = query.where(UsageDaily.day < until)
    return query


async def spent_by_tenant(session: AsyncSession, *, since: date) -> dict[str, int]:
    return {tenant: int(total) for tenant, total in await session.execute(
        spent_query(since=since))}


def _rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Complete column sets (one INSERT needs the same keys in every row), one per request."""
    seen: set[str] = set()
    rows = []
    for record in records:
        request_id = record["request_id"]
        if request_id in seen:
            continue
        seen.add(request_id)
        row = {**_DEFAULTS, **{k: v for k, v in record.items() if k in _COLUMNS}}
        row.setdefault("created_at", datetime.now(UTC))
        rows.append(row)
    return rows


@functools.cache
def _statements(dialect: str) -> tuple[Any, Any]:
    """The record insert (skipping request ids already stored, returning those inserted) and
    the aggregate upsert, for a dialect; built once."""
    if dialect == "postgresql":
        insert: Any = postgresql.insert
    elif dialect == "sqlite":
        insert = sqlite.insert
    else:
        raise NotImplementedError(f"usage writes support PostgreSQL and SQLite, not {dialect}")
    records = UsageRecord.__table__
    daily = UsageDaily.__table__
    record_insert = (insert(records).on_conflict_do_nothing(index_elements=["request_id"])
                     .returning(records.c.request_id))
    upsert = insert(daily)
    upsert = upsert.on_conflict_do_update(
        index_elements=list(AGGREGATE_KEY),
        set_={name: daily.c[name] + upsert.excluded[name] for name in SUMS})
    return record_insert, upsert
