"""Usage records out of the database: filtered, keyset-paginated pages, and exports streamed
from a server-side cursor in CSV or JSON Lines.

The admin API, the tenant API and the CLI all go through here, so a CSV from the shell and a
CSV from the API are the same bytes. Exports never hold more than one chunk of rows: memory
stays flat however many rows match (see bench/usage_export.py).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, Select, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.money import usd
from tenancy.models import UsageRecord

ExportFormat = Literal["csv", "jsonl"]
Order = Literal["asc", "desc"]
FORMATS: tuple[ExportFormat, ...] = ("csv", "jsonl")
MEDIA_TYPES: dict[str, str] = {"csv": "text/csv; charset=utf-8",
                               "jsonl": "application/x-ndjson"}
CHUNK_ROWS = 1000
MAX_PAGE = 1000

# Every column of a record, in export order; `cost_usd` (derived) follows `cost_micros`.
# `batch_id` and `batch_price_percent` are set on a batch line's record only (its costs are
# already that share of the live price); last, so older readers' column positions hold.
COLUMNS: tuple[str, ...] = (
    "id", "request_id", "created_at", "started_at", "tenant_id", "key_id", "model",
    "deployment", "adapter", "tier", "status", "cache_hit", "prompt_tokens",
    "completion_tokens", "cached_tokens", "input_cost_micros", "cached_cost_micros",
    "output_cost_micros", "cost_micros", "price_id", "queue_ms", "ttft_ms", "total_ms",
    "batch_id", "batch_price_percent",
)
# Live requests, or batch lines (records with a batch_id).
Origin = Literal["live", "batch"]
ORIGINS: tuple[Origin, ...] = ("live", "batch")
# What a tenant sees of its own records: not the upstream deployment or the price row.
TENANT_COLUMNS: tuple[str, ...] = tuple(c for c in COLUMNS if c not in ("deployment",
                                                                         "price_id"))
_DATETIMES = frozenset({"created_at", "started_at"})


def header(columns: Sequence[str]) -> list[str]:
    """Output field names: the columns, with `cost_usd` right after `cost_micros`."""
    out: list[str] = []
    for name in columns:
        out.append(name)
        if name == "cost_micros":
            out.append("cost_usd")
    return out


@dataclass(frozen=True, slots=True)
class RecordFilter:
    """Which records: every field narrows; None means any. [since, until) on `created_at`."""

    tenant_id: str | None = None
    key_id: str | None = None
    model: str | None = None
    status: str | None = None
    cache_hit: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    batch_id: str | None = None  # one batch's lines
    origin: Origin | None = None  # live requests only, or batch lines only

    def clauses(self) -> list[ColumnElement[bool]]:
        clauses: list[ColumnElement[bool]] = []
        for name in ("tenant_id", "key_id", "model", "status", "cache_hit", "batch_id"):
            value = getattr(self, name)
            if value is not None:
                clauses.append(getattr(UsageRecord, name) == value)
        if self.origin == "live":
            clauses.append(UsageRecord.batch_id.is_(None))
        elif self.origin == "batch":
            clauses.append(UsageRecord.batch_id.is_not(None))
        if self.since is not None:
            clauses.append(UsageRecord.created_at >= self.since)
        if self.until is not None:
            clauses.append(UsageRecord.created_at < self.until)
        return clauses


def records_query(*, filters: RecordFilter, columns: Sequence[str] = COLUMNS,
                  order: Order = "asc", after: int | None = None) -> Select[Any]:
    """Matching records by id (insertion order); `after` is a keyset cursor, never OFFSET."""
    query = select(*(getattr(UsageRecord, c) for c in columns)).where(*filters.clauses())
    if after is not None:
        query = query.where(UsageRecord.id > after if order == "asc" else UsageRecord.id < after)
    return query.order_by(UsageRecord.id.asc() if order == "asc" else UsageRecord.id.desc())


class _Shape:
    """How rows of `columns` become output values, worked out once per export."""

    def __init__(self, columns: Sequence[str]) -> None:
        self.names = header(columns)
        self.times = [i for i, name in enumerate(columns) if name in _DATETIMES]
        self.cost = columns.index("cost_micros") if "cost_micros" in columns else None

    def values(self, row: Sequence[Any]) -> list[Any]:
        """JSON-ready values in `names` order: ISO timestamps, `cost_usd` added."""
        values = list(row)
        for i in self.times:
            if values[i] is not None:
                values[i] = values[i].isoformat()
        if self.cost is not None:
            values.insert(self.cost + 1, usd(row[self.cost]))
        return values


def row_dict(row: Sequence[Any], columns: Sequence[str]) -> dict[str, Any]:
    """One record as JSON-ready values, in `header(columns)` order."""
    shape = _Shape(columns)
    return dict(zip(shape.names, shape.values(row), strict=True))


async def list_records(session: AsyncSession, *, filters: RecordFilter, limit: int = 100,
                       after: int | None = None, order: Order = "desc",
                       columns: Sequence[str] = COLUMNS,
                       ) -> tuple[list[dict[str, Any]], int | None]:
    """One page and the cursor of the next (None: this was the last page)."""
    if "id" not in columns:
        raise ValueError("pages need the id column for their cursor")
    limit = max(1, min(limit, MAX_PAGE))
    query = records_query(filters=filters, columns=columns, order=order, after=after)
    rows = (await session.execute(query.limit(limit + 1))).all()
    shape = _Shape(columns)
    page = [dict(zip(shape.names, shape.values(row), strict=True)) for row in rows[:limit]]
    return page, (page[-1]["id"] if len(rows) > limit else None)


@dataclass(slots=True)
class ExportStats:
    """Filled in while an export runs (the CLI reports it)."""

    rows: int = 0
    bytes: int = 0
    cost_micros: int = 0


async def export(session: AsyncSession, *, filters: RecordFilter, fmt: ExportFormat,
                 columns: Sequence[str] = COLUMNS, chunk_rows: int = CHUNK_ROWS,
                 stats: ExportStats | None = None) -> AsyncIterator[bytes]:
    """The export as UTF-8 byte chunks, oldest record first: CSV with a header row, or one
    JSON object a line. Money stays integer micro-USD; `cost_usd` is the exact decimal string
    beside it.

    Rows come `chunk_rows` at a time from a server-side cursor (an asyncpg cursor, aiosqlite
    fetchmany), so one chunk at most is in memory. The query runs before the first chunk is
    yielded: a caller that awaits that chunk learns of a database failure before it has
    promised anything (an HTTP status, a file)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}")
    stats = stats if stats is not None else ExportStats()
    shape = _Shape(columns)
    query = records_query(filters=filters, columns=columns, order="asc")
    # Core rows on the session's connection: plain columns need none of the ORM's loading.
    connection = await session.connection()
    result = await connection.stream(query.execution_options(yield_per=chunk_rows))
    try:
        if fmt == "csv":
            first = _csv_lines([shape.names]).encode()
            stats.bytes += len(first)
            yield first
        dumps = json.JSONEncoder(separators=(",", ":")).encode
        async for chunk in result.partitions(chunk_rows):
            if fmt == "csv":
                text = _csv_lines(shape.values(row) for row in chunk)
            else:
                text = "".join([dumps(dict(zip(shape.names, shape.values(row), strict=True)))
                                + "\n" for row in chunk])
            data = text.encode()
            stats.rows += len(chunk)
            stats.bytes += len(data)
            if shape.cost is not None:
                stats.cost_micros += sum(row[shape.cost] for row in chunk)
            yield data
    finally:
        await result.close()


def _csv_lines(rows: Any) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


def filename(*, fmt: ExportFormat, filters: RecordFilter) -> str:
    """A download name that says what is inside: usage[-tenant][-batch][-since][-until].csv"""
    parts = ["usage"]
    for name in (filters.tenant_id, filters.batch_id):
        if name:
            parts.append(re.sub(r"[^A-Za-z0-9_.-]", "_", name))
    for bound in (filters.since, filters.until):
        if bound is not None:
            utc = bound.astimezone(UTC) if bound.tzinfo is not None else bound
            parts.append(utc.strftime("%Y%m%dT%H%M%SZ"))
    return "-".join(parts) + "." + fmt
