"""A tenant's monthly invoice: line items per (model, tier, adapter) from the daily aggregates.

An open invoice (the current month, or a past one nobody closed) is computed on every read,
so it follows late usage. Closing stores the lines: from then on the invoice is only read
back, byte for byte, whatever arrives later. The same period always renders the same bytes
(stable order, no "generated at" field; only a closed invoice carries its `closed_at`).

Cached-token discount, per line: what the prompt tokens served from cache would have cost at
the line's effective input price, minus what they cost:

    discount = round(cached_tokens x input_cost / (prompt_tokens - cached_tokens)) - cached_cost

`input_cost / uncached prompt tokens` is the average price per uncached prompt token the
tenant actually paid on that line that month (markup included, every price version blended),
so no price book is consulted. A line without uncached prompt tokens has no such price and
its discount is 0; a discount is never negative. It is information only: the costs already
include it, and the total is the sum of `cost_micros`.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from datetime import UTC, date, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from billing import reports
from billing.models import Invoice
from billing.money import usd

_PERIOD = re.compile(r"^([0-9]{4})-(0[1-9]|1[0-2])$")
LINE_KEY = ("model", "tier", "adapter")


class InvoiceError(Exception):
    """A refused invoice operation; the message is for the caller."""


class PeriodNotOver(InvoiceError):
    """Only a month that has ended can be closed."""


class AlreadyClosed(InvoiceError):
    """A closed invoice is final."""


def parse_period(period: str) -> tuple[date, date]:
    """"2025-03" -> (2025-03-01, 2025-04-01): the UTC days [start, end) of the month."""
    match = _PERIOD.match(period)
    if match is None or int(match[1]) < 1:
        raise ValueError(f"period must be a month as YYYY-MM, not {period!r}")
    year, month = int(match[1]), int(match[2])
    start = date(year, month, 1)
    try:
        end = date(year + month // 12, month % 12 + 1, 1)
    except ValueError:  # December 9999
        end = date.max
    return start, end


def current_period(now: datetime | None = None) -> str:
    now = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{now.year:04d}-{now.month:02d}"


@dataclass(frozen=True, slots=True)
class Amounts:
    """The numbers of a line or of the totals; money in integer micro-USD."""

    requests: int = 0
    prompt_tokens: int = 0  # including the cached ones
    cached_tokens: int = 0
    completion_tokens: int = 0
    input_cost_micros: int = 0  # uncached prompt tokens
    cached_cost_micros: int = 0
    output_cost_micros: int = 0
    cost_micros: int = 0
    cached_discount_micros: int = 0

    def __add__(self, other: Amounts) -> Amounts:
        return Amounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def document(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in asdict(self).items():
            out[name] = value
            if name in ("cost_micros", "cached_discount_micros"):
                out[name.replace("_micros", "_usd")] = usd(value)
        return out


@dataclass(frozen=True, slots=True)
class InvoiceLine:
    model: str
    tier: str
    adapter: str
    amounts: Amounts

    def document(self) -> dict[str, Any]:
        return {"model": self.model, "tier": self.tier, "adapter": self.adapter,
                **self.amounts.document()}

    def stored(self) -> dict[str, Any]:
        """What a closed invoice keeps: integers and names, no derived strings."""
        return {"model": self.model, "tier": self.tier, "adapter": self.adapter,
                **asdict(self.amounts)}

    @classmethod
    def from_stored(cls, data: dict[str, Any]) -> InvoiceLine:
        amounts = Amounts(**{f.name: int(data.get(f.name, 0)) for f in fields(Amounts)})
        return cls(str(data["model"]), str(data["tier"]), str(data["adapter"]), amounts)


AMOUNT_FIELDS: tuple[str, ...] = tuple(Amounts().document())
CSV_HEADER: tuple[str, ...] = ("line", *LINE_KEY, *AMOUNT_FIELDS)


@dataclass(frozen=True, slots=True)
class InvoiceView:
    tenant_id: str
    period: str
    status: str  # "open" (computed now) or "closed" (stored)
    lines: tuple[InvoiceLine, ...]
    closed_at: datetime | None = None

    @property
    def totals(self) -> Amounts:
        return sum((line.amounts for line in self.lines), Amounts())

    def document(self) -> dict[str, Any]:
        """The invoice as JSON-ready data, keys and lines in a fixed order."""
        start, end = parse_period(self.period)
        totals = self.totals
        return {
            "object": "invoice",
            "tenant_id": self.tenant_id,
            "period": self.period,
            "period_start": start.isoformat(),
            "period_end": end.isoformat(),
            "status": self.status,
            "currency": "usd",
            "closed_at": None if self.closed_at is None else self.closed_at.isoformat(),
            "lines": [line.document() for line in self.lines],
            "totals": totals.document(),
            "total_micros": totals.cost_micros,
            "total_usd": usd(totals.cost_micros),
        }

    def csv(self) -> str:
        """One row per line, then a `total` row; same columns as the JSON lines."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(CSV_HEADER)
        for line in self.lines:
            doc = line.amounts.document()
            writer.writerow(["item", line.model, line.tier, line.adapter,
                             *(doc[name] for name in AMOUNT_FIELDS)])
        doc = self.totals.document()
        writer.writerow(["total", "", "", "", *(doc[name] for name in AMOUNT_FIELDS)])
        return buffer.getvalue()


def cached_discount(*, prompt_tokens: int, cached_tokens: int, input_cost_micros: int,
                    cached_cost_micros: int) -> int:
    """See the module docstring; half-micro-USD rounds up."""
    uncached = prompt_tokens - cached_tokens
    if cached_tokens <= 0 or uncached <= 0:
        return 0
    at_input_price = (2 * cached_tokens * input_cost_micros + uncached) // (2 * uncached)
    return max(0, at_input_price - cached_cost_micros)


async def compute_lines(session: AsyncSession, *, tenant_id: str, period: str
                        ) -> tuple[InvoiceLine, ...]:
    """The month's lines from the daily aggregates, ordered by (model, tier, adapter)."""
    start, end = parse_period(period)
    rows = await reports.grouped(session, group_by=LINE_KEY, where=reports.filters(
        tenant_id=tenant_id, since=start, until=end))
    # Sorted here, not in SQL: collations differ between backends, bytes must not.
    return tuple(sorted((_line(row) for row in rows), key=_line_key))


async def get_invoice(session: AsyncSession, *, tenant_id: str, period: str) -> InvoiceView:
    """The stored invoice if the period is closed, else the open one as of now."""
    parse_period(period)
    stored = await _stored(session, tenant_id=tenant_id, period=period)
    if stored is not None:
        return _view(stored)
    lines = await compute_lines(session, tenant_id=tenant_id, period=period)
    return InvoiceView(tenant_id, period, "open", lines)


async def close_invoice(session: AsyncSession, *, tenant_id: str, period: str,
                        now: datetime | None = None) -> InvoiceView:
    """Freeze a finished month's invoice. Usage arriving later changes exports and reports,
    not this invoice."""
    now = (now or datetime.now(UTC)).astimezone(UTC).replace(microsecond=0)
    parse_period(period)
    if period >= current_period(now):
        raise PeriodNotOver(f"period {period} has not ended yet; only past months can be "
                            "closed")
    if await _stored(session, tenant_id=tenant_id, period=period) is not None:
        raise AlreadyClosed(f"the invoice for {period} is already closed")
    lines = await compute_lines(session, tenant_id=tenant_id, period=period)
    view = InvoiceView(tenant_id, period, "closed", lines, closed_at=now)
    session.add(Invoice(tenant_id=tenant_id, period=period, status="closed",
                        total_micros=view.totals.cost_micros,
                        lines=[line.stored() for line in lines], closed_at=now))
    try:
        await session.commit()
    except IntegrityError:  # closed concurrently
        await session.rollback()
        raise AlreadyClosed(f"the invoice for {period} is already closed") from None
    return view


async def list_closed(session: AsyncSession, *, tenant_id: str) -> Sequence[Invoice]:
    """A tenant's closed invoices, oldest period first."""
    result = await session.scalars(select(Invoice).where(Invoice.tenant_id == tenant_id)
                                   .order_by(Invoice.period))
    return result.all()


async def _stored(session: AsyncSession, *, tenant_id: str, period: str) -> Invoice | None:
    return await session.scalar(select(Invoice).where(
        Invoice.tenant_id == tenant_id, Invoice.period == period))


def _view(invoice: Invoice) -> InvoiceView:
    lines = sorted((InvoiceLine.from_stored(d) for d in invoice.lines), key=_line_key)
    return InvoiceView(invoice.tenant_id, invoice.period, invoice.status, tuple(lines),
                       closed_at=invoice.closed_at)


def _line_key(line: InvoiceLine) -> tuple[str, str, str]:
    return line.model, line.tier, line.adapter


def _line(row: reports.ReportRow) -> InvoiceLine:
    m = row.metrics
    amounts = Amounts(
        requests=m.requests, prompt_tokens=m.prompt_tokens, cached_tokens=m.cached_tokens,
        completion_tokens=m.completion_tokens, input_cost_micros=m.input_cost_micros,
        cached_cost_micros=m.cached_cost_micros, output_cost_micros=m.output_cost_micros,
        cost_micros=m.cost_micros,
        cached_discount_micros=cached_discount(
            prompt_tokens=m.prompt_tokens, cached_tokens=m.cached_tokens,
            input_cost_micros=m.input_cost_micros, cached_cost_micros=m.cached_cost_micros))
    return InvoiceLine(row.group["model"], row.group["tier"], row.group["adapter"], amounts)
