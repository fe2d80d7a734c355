"""Invoices: lines per (model, tier, adapter) that sum to the tenant's month, the cached-token
discount as documented, closing that freezes, and the same bytes on every read."""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest

from billing import invoices
from tests.billing.test_export import T0, make_records, sessionmaker, write

__all__ = ["sessionmaker"]  # the fixture, shared with test_export
AFTER_MARCH = datetime(2025, 4, 2, 9, 30, tzinfo=UTC)
SUMMED = ("prompt_tokens", "cached_tokens", "completion_tokens", "input_cost_micros",
          "cached_cost_micros", "output_cost_micros", "cost_micros")


def month_lines(records: list[dict[str, Any]], tenant: str, period: str
                ) -> dict[tuple[str, str, str], dict[str, int]]:
    start, end = invoices.parse_period(period)
    lines: dict[tuple[str, str, str], dict[str, int]] = defaultdict(
        lambda: dict.fromkeys(("requests", *SUMMED), 0))
    for r in records:
        if r["tenant_id"] == tenant and start <= r["created_at"].date() < end:
            line = lines[(r["model"], r["tier"], r["adapter"])]
            line["requests"] += 1
            for name in SUMMED:
                line[name] += r[name]
    return dict(lines)


def encoded(view: invoices.InvoiceView) -> bytes:
    return json.dumps(view.document(), separators=(",", ":")).encode()


async def test_lines_sum_to_the_months_usage(sessionmaker):
    records = make_records(200)  # March into May, two tenants
    async with sessionmaker() as session:
        await write(session, records)
        view = await invoices.get_invoice(session, tenant_id="ta", period="2025-03")
    want = month_lines(records, "ta", "2025-03")
    assert view.status == "open" and view.closed_at is None
    got = {(line.model, line.tier, line.adapter): line.amounts for line in view.lines}
    assert list(got) == sorted(want)
    for key, amounts in got.items():
        assert {n: getattr(amounts, n) for n in ("requests", *SUMMED)} == want[key]
        assert amounts.cached_discount_micros == invoices.cached_discount(
            prompt_tokens=amounts.prompt_tokens, cached_tokens=amounts.cached_tokens,
            input_cost_micros=amounts.input_cost_micros,
            cached_cost_micros=amounts.cached_cost_micros)
    doc = view.document()
    march = [r for r in records if r["tenant_id"] == "ta" and r["created_at"].month == 3]
    assert doc["total_micros"] == sum(r["cost_micros"] for r in march)
    assert doc["total_micros"] == sum(line["cost_micros"] for line in doc["lines"])
    assert doc["totals"]["requests"] == len(march)
    for name in (*SUMMED, "cached_discount_micros"):
        assert doc["totals"][name] == sum(line[name] for line in doc["lines"])
    assert doc["total_usd"] == invoices.usd(doc["total_micros"])
    assert (doc["period_start"], doc["period_end"]) == ("2025-03-01", "2025-04-01")
    assert doc["totals"]["cached_discount_micros"] > 0  # cached tokens at 1, input at 2

    rows = list(csv.DictReader(io.StringIO(view.csv())))
    assert [r["line"] for r in rows] == ["item"] * len(view.lines) + ["total"]
    assert int(rows[-1]["cost_micros"]) == doc["total_micros"]
    assert rows[-1]["cost_usd"] == doc["total_usd"]
    assert sum(int(r["requests"]) for r in rows[:-1]) == len(march)


async def test_closing_freezes_and_reads_are_reproducible(sessionmaker):
    records = make_records(160)
    async with sessionmaker() as session:
        await write(session, records)
        first = await invoices.get_invoice(session, tenant_id="ta", period="2025-03")
        again = await invoices.get_invoice(session, tenant_id="ta", period="2025-03")
        assert encoded(first) == encoded(again)
        assert first.csv() == again.csv()

        closed = await invoices.close_invoice(session, tenant_id="ta", period="2025-03",
                                              now=AFTER_MARCH)
        assert closed.status == "closed" and closed.closed_at == AFTER_MARCH
        assert closed.lines == first.lines
        stored = await invoices.get_invoice(session, tenant_id="ta", period="2025-03")
        assert encoded(stored) == encoded(closed)

        # Late usage for March: the closed invoice stays; an open month follows it.
        april_before = await invoices.get_invoice(session, tenant_id="ta", period="2025-04")
        late = [{**r, "request_id": "late-" + r["request_id"]} for r in make_records(
            4, tenants=("ta",), start=datetime(2025, 3, 30, tzinfo=UTC), step=timedelta(days=1))]
        await write(session, late)
        assert encoded(await invoices.get_invoice(
            session, tenant_id="ta", period="2025-03")) == encoded(closed)
        april_after = await invoices.get_invoice(session, tenant_id="ta", period="2025-04")
        added = sum(r["cost_micros"] for r in late if r["created_at"].month == 4)
        assert april_after.totals.cost_micros == april_before.totals.cost_micros + added
        assert april_after.totals.requests == april_before.totals.requests + 2

        with pytest.raises(invoices.AlreadyClosed):
            await invoices.close_invoice(session, tenant_id="ta", period="2025-03",
                                         now=AFTER_MARCH)
        for period in ("2025-04", "2025-05", "2031-01"):
            with pytest.raises(invoices.PeriodNotOver):
                await invoices.close_invoice(session, tenant_id="ta", period=period,
                                             now=AFTER_MARCH)
        # Another tenant's month is its own invoice.
        other = await invoices.close_invoice(session, tenant_id="tb", period="2025-03",
                                             now=AFTER_MARCH)
        assert other.totals.cost_micros == sum(
            r["cost_micros"] for r in records if r["tenant_id"] == "tb"
            and r["created_at"].month == 3)
        assert [p.period for p in await invoices.list_closed(session, tenant_id="ta")] == [
            "2025-03"]


async def test_an_empty_month(sessionmaker):
    async with sessionmaker() as session:
        view = await invoices.get_invoice(session, tenant_id="nobody", period="2024-02")
        assert view.lines == () and view.document()["total_usd"] == "0.000000"
        closed = await invoices.close_invoice(session, tenant_id="nobody", period="2024-02")
        assert closed.document()["lines"] == [] and closed.document()["status"] == "closed"


def test_cached_discount_definition():
    # 60 uncached prompt tokens cost 120: 2 per token. 40 cached at that price is 80; they
    # cost 20, so the discount is 60.
    assert invoices.cached_discount(prompt_tokens=100, cached_tokens=40,
                                    input_cost_micros=120, cached_cost_micros=20) == 60
    # Rounded half up on the exact fraction: 1 x 10/3 = 3.33 -> 3; 2 x 10/3 = 6.67 -> 7.
    assert invoices.cached_discount(prompt_tokens=4, cached_tokens=1, input_cost_micros=10,
                                    cached_cost_micros=0) == 3
    assert invoices.cached_discount(prompt_tokens=5, cached_tokens=2, input_cost_micros=10,
                                    cached_cost_micros=0) == 7
    # No uncached tokens: no price to compare with. Never negative.
    assert invoices.cached_discount(prompt_tokens=9, cached_tokens=9, input_cost_micros=0,
                                    cached_cost_micros=5) == 0
    assert invoices.cached_discount(prompt_tokens=9, cached_tokens=0, input_cost_micros=9,
                                    cached_cost_micros=0) == 0
    assert invoices.cached_discount(prompt_tokens=10, cached_tokens=5, input_cost_micros=5,
                                    cached_cost_micros=50) == 0


def test_periods():
    assert invoices.parse_period("2025-03") == (date(2025, 3, 1), date(2025, 4, 1))
    assert invoices.parse_period("2024-12") == (date(2024, 12, 1), date(2025, 1, 1))
    for bad in ("2025-13", "2025-00", "2025-3", "25-03", "0000-01", "2025-03-01", "", "x"):
        with pytest.raises(ValueError):
            invoices.parse_period(bad)
    assert invoices.current_period(T0 + timedelta(days=40)) == "2025-04"
