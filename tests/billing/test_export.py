"""Exports and record pages read back exactly what was written, on SQLite and PostgreSQL:
CSV and JSONL parse to the same rows and sums, keyset pages visit every row once, filters
narrow as documented, and money stays integer micro-USD with exact USD strings."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing import export, ledger
from billing.money import usd
from tenancy.db import make_engine, make_sessionmaker
from tests.dbutil import BACKENDS, migrated_database

T0 = datetime(2025, 3, 1, tzinfo=UTC)
MODELS = ("alpha", "beta", "gamma")


def make_records(n: int, *, tenants: tuple[str, ...] = ("ta", "tb"), start: datetime = T0,
                 step: timedelta = timedelta(hours=7), prefix: str = "r",
                 ) -> list[dict[str, Any]]:
    """Varied records: tenants, keys, models, tiers, adapters, statuses, cache hits, cached
    prompt tokens, priced per part like billing.pricing (input 2, cached 1, output 4 micros
    per token); every fifth a batch line (its tenant's batch, charged 50%)."""
    records = []
    for i in range(n):
        tenant = tenants[i % len(tenants)]
        prompt, completion = 10 + i % 17, 3 + i % 11
        cached = min(prompt, (i % 5) * 3)
        hit = "exact" if i % 13 == 0 else "semantic" if i % 17 == 0 else "none"
        if hit != "none":
            cached = prompt
        parts = {"input_cost_micros": 2 * (prompt - cached), "cached_cost_micros": cached,
                 "output_cost_micros": 4 * completion}
        records.append({
            "request_id": f"{prefix}{i:06d}", "tenant_id": tenant, "key_id": f"k-{tenant}-{i % 2}",
            "model": MODELS[i % 3], "deployment": f"dep-{i % 2}", "tier": ("std", "prem")[i % 2],
            "adapter": "ad-1" if i % 7 == 0 else "", "status": "ok" if i % 9 else "error",
            "cache_hit": hit, "prompt_tokens": prompt, "completion_tokens": completion,
            "cached_tokens": cached, **parts, "cost_micros": sum(parts.values()),
            "price_id": f"p{i % 2}", "queue_ms": 0.5 * (i % 4), "ttft_ms": 12.25, "total_ms": None,
            "started_at": start + step * i - timedelta(seconds=1),
            "created_at": start + step * i,
            "batch_id": f"batch_{tenant}" if i % 5 == 2 else None,
            "batch_price_percent": 50 if i % 5 == 2 else None,
        })
    return records


async def write(session: AsyncSession, records: list[dict[str, Any]]) -> None:
    for i in range(0, len(records), 500):
        await ledger.write_batch(session, records=records[i:i + 500])


@pytest.fixture(params=BACKENDS)
async def sessionmaker(request: pytest.FixtureRequest, tmp_path: Path
                       ) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    async with migrated_database(request.param, tmp_path) as url:
        engine = make_engine(url)
        yield make_sessionmaker(engine)
        await engine.dispose()


@pytest.fixture
async def written(sessionmaker) -> list[dict[str, Any]]:
    records = make_records(120)
    async with sessionmaker() as session:
        await write(session, records)
    return records


async def run_export(sessionmaker, fmt: str, **kwargs: Any) -> tuple[bytes, export.ExportStats]:
    stats = export.ExportStats()
    async with sessionmaker() as session:
        chunks = [c async for c in export.export(session, fmt=fmt, stats=stats, **kwargs)]
    return b"".join(chunks), stats


def comparable(record: dict[str, Any]) -> dict[str, Any]:
    """A written record as an export shows it (JSON types, ISO timestamps)."""
    out = {k: v.isoformat() if isinstance(v, datetime) else v for k, v in record.items()}
    out["cost_usd"] = usd(record["cost_micros"])
    return out


def from_csv(row: dict[str, str]) -> dict[str, Any]:
    """A CSV row parsed back with the column types (empty cells are None)."""
    ints = {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "input_cost_micros",
            "cached_cost_micros", "output_cost_micros", "cost_micros"}
    floats = {"queue_ms", "ttft_ms", "total_ms"}
    out: dict[str, Any] = {}
    for name, value in row.items():
        if name in ints:
            out[name] = int(value)
        elif name in floats:
            out[name] = float(value) if value else None
        elif name == "batch_price_percent":
            out[name] = int(value) if value else None
        elif value == "" and name in ("key_id", "price_id", "started_at", "batch_id"):
            out[name] = None
        else:
            out[name] = value
    return out


@pytest.mark.parametrize("fmt", export.FORMATS)
async def test_export_round_trip(sessionmaker, written, fmt):
    data, stats = await run_export(sessionmaker, fmt, filters=export.RecordFilter(),
                                   chunk_rows=7)
    text = data.decode()
    if fmt == "csv":
        reader = csv.DictReader(io.StringIO(text))
        assert reader.fieldnames == export.header(export.COLUMNS)
        rows = [from_csv(r) for r in reader]
    else:
        rows = [json.loads(line) for line in text.splitlines()]
        assert all(list(r) == export.header(export.COLUMNS) for r in rows)
    assert len(rows) == stats.rows == len(written)
    assert stats.bytes == len(data)
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)  # oldest first
    by_request = {r["request_id"]: r for r in rows}
    for record in written:
        got = dict(by_request[record["request_id"]])
        got.pop("id")
        assert {k: got[k] for k in comparable(record)} == comparable(record)
        assert set(got) - set(comparable(record)) == set()
    for name in ("cost_micros", "input_cost_micros", "cached_cost_micros", "output_cost_micros",
                 "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert sum(r[name] for r in rows) == sum(r[name] for r in written)
    assert stats.cost_micros == sum(r["cost_micros"] for r in written)


async def test_export_filters(sessionmaker, written):
    since, until = T0 + timedelta(days=3), T0 + timedelta(days=20)
    cases = [
        (export.RecordFilter(tenant_id="ta"), lambda r: r["tenant_id"] == "ta"),
        (export.RecordFilter(tenant_id="tb", model="beta"),
         lambda r: r["tenant_id"] == "tb" and r["model"] == "beta"),
        (export.RecordFilter(status="error"), lambda r: r["status"] == "error"),
        (export.RecordFilter(cache_hit="exact"), lambda r: r["cache_hit"] == "exact"),
        (export.RecordFilter(key_id="k-ta-0"), lambda r: r["key_id"] == "k-ta-0"),
        (export.RecordFilter(since=since, until=until),
         lambda r: since <= r["created_at"] < until),
        (export.RecordFilter(tenant_id="nobody"), lambda r: False),
        (export.RecordFilter(origin="batch"), lambda r: r["batch_id"] is not None),
        (export.RecordFilter(origin="live"), lambda r: r["batch_id"] is None),
        (export.RecordFilter(batch_id="batch_ta"), lambda r: r["batch_id"] == "batch_ta"),
        (export.RecordFilter(tenant_id="tb", origin="batch"),
         lambda r: r["tenant_id"] == "tb" and r["batch_id"] is not None),
    ]
    for filters, keep in cases:
        data, stats = await run_export(sessionmaker, "jsonl", filters=filters)
        got = [json.loads(line)["request_id"] for line in data.decode().splitlines()]
        expected = [r["request_id"] for r in written if keep(r)]
        assert got == expected, filters
        assert expected or filters.tenant_id == "nobody", filters  # every other case bites
        assert stats.rows == len(expected)
    # An empty CSV still has its header.
    data, _ = await run_export(sessionmaker, "csv", filters=export.RecordFilter(model="none"))
    assert data.decode().splitlines() == [",".join(export.header(export.COLUMNS))]


@pytest.mark.parametrize("order", ["asc", "desc"])
async def test_keyset_pages_visit_every_row_once(sessionmaker, written, order):
    filters = export.RecordFilter(tenant_id="tb")
    seen: list[int] = []
    after, pages = None, 0
    async with sessionmaker() as session:
        while True:
            page, after = await export.list_records(session, filters=filters, limit=9,
                                                    after=after, order=order)
            pages += 1
            seen += [r["id"] for r in page]
            assert all(r["tenant_id"] == "tb" for r in page)
            if after is None:
                break
            # A row written between pages never shifts the walk (asc picks it up at the end).
        expected = len([r for r in written if r["tenant_id"] == "tb"])
    assert len(seen) == len(set(seen)) == expected
    assert seen == sorted(seen, reverse=order == "desc")
    assert pages == -(-expected // 9)


async def test_pages_are_stable_while_rows_arrive(sessionmaker, written):
    async with sessionmaker() as session:
        first, after = await export.list_records(
            session, filters=export.RecordFilter(), limit=50, order="asc")
        await write(session, make_records(10, start=T0 + timedelta(days=60), prefix="late"))
        rest: list[dict[str, Any]] = []
        while after is not None:
            page, after = await export.list_records(
                session, filters=export.RecordFilter(), limit=50, after=after, order="asc")
            rest += page
    ids = [r["id"] for r in first + rest]
    assert len(ids) == len(set(ids)) == len(written) + 10


def test_usd_is_exact():
    assert usd(0) == "0.000000"
    assert usd(1) == "0.000001"
    assert usd(1_234_567) == "1.234567"
    assert usd(10**15 + 5) == "1000000000.000005"
    assert usd(-250_000) == "-0.250000"


def test_filename_names_the_range():
    filters = export.RecordFilter(tenant_id="t:1", since=datetime(2025, 3, 1, 2, tzinfo=UTC),
                                  until=datetime(2025, 4, 1))
    assert export.filename(fmt="csv", filters=filters) == (
        "usage-t_1-20250301T020000Z-20250401T000000Z.csv")
    assert export.filename(fmt="jsonl", filters=export.RecordFilter()) == "usage.jsonl"
    assert export.filename(fmt="csv", filters=export.RecordFilter(
        tenant_id="t1", batch_id="batch_9")) == "usage-t1-batch_9.csv"
