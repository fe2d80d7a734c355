"""Summaries come from the daily aggregates alone and agree with the records they count."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import delete

from billing import reports
from tenancy.models import UsageRecord
from tests.billing.test_export import make_records, sessionmaker, write

__all__ = ["sessionmaker"]  # the fixture, shared with test_export


def expected(records: list[dict[str, Any]], key: Any) -> dict[Any, dict[str, int]]:
    sums: dict[Any, dict[str, int]] = defaultdict(lambda: dict.fromkeys(reports.METRIC_NAMES, 0))
    for r in records:
        s = sums[key(r)]
        s["requests"] += 1
        s["errors"] += r["status"] != "ok"
        s["cache_hits"] += r["cache_hit"] != "none"
        for name in reports.METRIC_NAMES[3:]:
            s[name] += r[name]
    return dict(sums)


def as_dict(metrics: reports.Metrics) -> dict[str, int]:
    return {name: getattr(metrics, name) for name in reports.METRIC_NAMES}


async def test_groups_and_totals_match_the_records(sessionmaker):
    records = make_records(150)
    async with sessionmaker() as session:
        await write(session, records)
        # Reports never read the raw table: with it emptied they answer the same.
        await session.execute(delete(UsageRecord))
        await session.commit()

        report = await reports.summarize(session, group_by=("tenant", "model"))
        want = expected(records, lambda r: (r["tenant_id"], r["model"]))
        assert {(r.group["tenant"], r.group["model"]): as_dict(r.metrics)
                for r in report.rows} == want
        assert [(r.group["tenant"], r.group["model"]) for r in report.rows] == sorted(want)
        assert as_dict(report.totals) == expected(records, lambda r: 0)[0]

        report = await reports.summarize(session, tenant_id="ta", group_by=("day",))
        mine = [r for r in records if r["tenant_id"] == "ta"]
        want = expected(mine, lambda r: r["created_at"].date().isoformat())
        assert {r.group["day"]: as_dict(r.metrics) for r in report.rows} == want

        since, until = date(2025, 3, 5), date(2025, 3, 12)
        report = await reports.summarize(session, since=since, until=until, group_by=("tier",))
        window = [r for r in records if since <= r["created_at"].date() < until]
        assert {r.group["tier"]: as_dict(r.metrics) for r in report.rows} == expected(
            window, lambda r: r["tier"])

        report = await reports.summarize(session, model="beta", group_by=("adapter",))
        assert report.totals.requests == sum(r["model"] == "beta" for r in records)
        empty = await reports.summarize(session, tenant_id="nobody", group_by=("day",))
        assert (empty.rows, empty.totals) == ([], reports.Metrics())


async def test_one_snapshot_keeps_a_batch_committed_between_two_summaries_out(sessionmaker):
    """A report built from two summaries (by day, then by model) must not count a usage batch
    in one and not the other, as a tenant's `/v1/usage` did when the meter wrote between them."""
    records = make_records(20)
    async with sessionmaker() as session:
        await write(session, records[:10])
    async with sessionmaker() as reader:
        await reports.one_snapshot(reader)
        by_day = await reports.summarize(reader, group_by=("day",))
        async with sessionmaker() as writer:
            await write(writer, records[10:])
        by_model = await reports.summarize(reader, group_by=("model",))
        assert by_day.totals.requests == by_model.totals.requests == 10
    async with sessionmaker() as fresh:
        assert (await reports.summarize(fresh, group_by=("model",))).totals.requests == 20


def test_rates():
    m = reports.Metrics(requests=8, errors=1, cache_hits=3)
    assert (m.error_rate, m.cache_hit_rate) == (0.125, 0.375)
    assert (reports.Metrics().error_rate, reports.Metrics().cache_hit_rate) == (0.0, 0.0)
    assert reports.metrics_dict(reports.Metrics(cost_micros=1_500_000))["cost_usd"] == "1.500000"


def test_day_bounds_cover_the_asked_period():
    assert reports.day_bounds(None, None) == (None, None)
    assert reports.day_bounds(datetime(2025, 3, 1, 23, 59, tzinfo=UTC),
                              datetime(2025, 3, 4, 0, 0, tzinfo=UTC)) == (
        date(2025, 3, 1), date(2025, 3, 4))
    assert reports.day_bounds(None, datetime(2025, 3, 4, 0, 1)) == (None, date(2025, 3, 5))
    # Offsets are converted to UTC days first.
    plus5 = datetime(2025, 3, 2, 3, 0, tzinfo=timezone(timedelta(hours=5)))
    assert reports.day_bounds(plus5, plus5) == (date(2025, 3, 1), date(2025, 3, 2))
    assert reports.day_bounds(date(2025, 1, 1), date(2025, 2, 1)) == (
        date(2025, 1, 1), date(2025, 2, 1))
    assert reports.day_bounds(None, datetime(9999, 12, 31, 12, tzinfo=UTC)) == (None, None)


def test_group_by_parsing():
    assert reports.parse_group_by("day, model,day") == ("day", "model")
    for bad in ("", "week", "day,tenant_id"):
        with pytest.raises(ValueError, match="group_by"):
            reports.parse_group_by(bad)
    with pytest.raises(ValueError):
        reports.parse_group_by("tenant", allowed=reports.TENANT_DIMENSIONS)
