"""Usage dashboards, exports and invoices.

Charts and tables read only the daily aggregates (`billing.reports`): three grouped queries
and the tenant list per page, whatever the traffic. Downloads are the admin API's
(`gateway.downloads`), behind the console's session instead of a bearer key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any

from fastapi import Request
from starlette.responses import Response

from billing import export, invoices, reports
from gateway import downloads
from gateway.console.auth import AdminSession
from gateway.console.render import page
from gateway.console.routing import console_router
from gateway.deps import SessionDep, StateDep
from tenancy import tenants

router = console_router()
DEFAULT_DAYS = 30
MAX_DAYS = 366  # one chart point per day
TOP_TENANTS = 10
REFRESH_SECONDS = 5
BATCH_ID_MAX = 40  # the column's length


@dataclass(frozen=True, slots=True)
class UsageFilter:
    """The dashboard's filters; days are whole UTC days, `last` inclusive."""

    tenant_id: str | None
    model: str | None
    tier: str | None
    first: date
    last: date
    errors: dict[str, str]

    @classmethod
    def of(cls, request: Request) -> UsageFilter:
        q = request.query_params
        errors: dict[str, str] = {}
        today = datetime.now(UTC).date()
        last = _day(q.get("until"), today, "until", errors)
        first = _day(q.get("since"), last - timedelta(days=DEFAULT_DAYS - 1), "since", errors)
        if first > last:
            errors["since"] = "The first day must not be after the last."
            first = last
        if (last - first).days >= MAX_DAYS:
            errors["since"] = f"Pick at most {MAX_DAYS} days."
            first = last - timedelta(days=MAX_DAYS - 1)
        return cls(q.get("tenant_id") or None, q.get("model") or None, q.get("tier") or None,
                   first, last, errors)

    @property
    def until(self) -> date:
        return self.last + timedelta(days=1)

    def query(self) -> dict[str, str]:
        values = {"tenant_id": self.tenant_id, "model": self.model, "tier": self.tier,
                  "since": self.first.isoformat(), "until": self.last.isoformat()}
        return {k: v for k, v in values.items() if v}

    def records(self) -> export.RecordFilter:
        """The same period and scope for raw-record exports (which cannot filter by tier)."""
        return export.RecordFilter(
            tenant_id=self.tenant_id, model=self.model,
            since=datetime.combine(self.first, datetime.min.time(), UTC),
            until=datetime.combine(self.until, datetime.min.time(), UTC))


@router.get("/usage")
async def usage_page(request: Request, admin: AdminSession, session: SessionDep) -> Response:
    f = UsageFilter.of(request)
    scope = {"since": f.first, "until": f.until}
    await reports.one_snapshot(session)
    by_day = await reports.summarize(session, tenant_id=f.tenant_id, model=f.model,
                                     tier=f.tier, group_by=("day",), **scope)
    by_tenant = await reports.summarize(session, tenant_id=f.tenant_id, model=f.model,
                                        tier=f.tier, group_by=("tenant",), **scope)
    # Not narrowed by model or tier: these rows also list the choices for those filters.
    by_model = await reports.summarize(session, tenant_id=f.tenant_id,
                                       group_by=("model", "tier"), **scope)
    listed = await tenants.list_tenants(session)
    top = sorted(by_tenant.rows, key=lambda r: (-r.metrics.cost_micros,
                                                -r.metrics.requests))[:TOP_TENANTS]
    return page(request, "usage.html", {
        "admin": admin, "title": "Usage", "nav": "usage", "f": f, "refresh_s": REFRESH_SECONDS,
        "totals": by_day.totals, "top": top, "by_model": by_model.rows,
        "tenant_names": {t.id: t.name for t in listed}, "tenants": listed,
        "models": sorted({r.group["model"] for r in by_model.rows}),
        "tiers": sorted({r.group["tier"] for r in by_model.rows}),
        "chart": json.dumps(_chart(by_day, f)), "query": f.query(),
        "period": invoices.current_period(),
    }, fragment="_usage_panel.html", status_code=400 if f.errors else 200)


@router.get("/usage/export")
async def usage_export(request: Request, admin: AdminSession, state: StateDep,
                       format: str = "csv", origin: str = "", batch_id: str = "") -> Response:
    """The page's records; `origin` (live or batch) and `batch_id` narrow them further (the
    charts cannot: the daily aggregates do not tell batch lines apart)."""
    if format not in export.FORMATS:
        return _plain_error("format must be csv or jsonl")
    chosen = next((o for o in export.ORIGINS if o == origin), None)
    if origin and chosen is None:
        return _plain_error("origin must be live or batch")
    if len(batch_id) > BATCH_ID_MAX:
        return _plain_error("batch_id is too long")
    f = UsageFilter.of(request)
    filters = replace(f.records(), origin=chosen, batch_id=batch_id or None)
    return await downloads.usage_export(state.sessionmaker, filters,
                                        format)  # type: ignore[arg-type]


@router.get("/usage/invoice")
async def usage_invoice(admin: AdminSession, session: SessionDep, tenant_id: str = "",
                        period: str = "", format: str = "json") -> Response:
    if format not in ("json", "csv"):
        return _plain_error("format must be json or csv")
    try:
        invoices.parse_period(period)
    except ValueError as exc:
        return _plain_error(str(exc))
    if await tenants.get_tenant(session, tenant_id=tenant_id) is None:
        return _plain_error("Pick a tenant.", status_code=404)
    view = await invoices.get_invoice(session, tenant_id=tenant_id, period=period)
    return downloads.invoice(view, format)


def _plain_error(message: str, *, status_code: int = 400) -> Response:
    return Response(message, status_code=status_code, media_type="text/plain; charset=utf-8")


def _chart(report: reports.Report, f: UsageFilter) -> dict[str, Any]:
    """Every day of the period (zeros where nothing ran), for Chart.js."""
    rows = {r.group["day"]: r.metrics for r in report.rows}
    days = [(f.first + timedelta(days=i)).isoformat() for i in range((f.last - f.first).days + 1)]
    empty = reports.Metrics()
    return {
        "days": days,
        "prompt_tokens": [rows.get(d, empty).prompt_tokens for d in days],
        "completion_tokens": [rows.get(d, empty).completion_tokens for d in days],
        "cost_usd": [rows.get(d, empty).cost_micros / 1_000_000 for d in days],
        "requests": [rows.get(d, empty).requests for d in days],
    }


def _day(value: str | None, default: date, name: str, errors: dict[str, str]) -> date:
    if not value:
        return default
    try:
        return date.fromisoformat(value)
    except ValueError:
        errors[name] = "Enter a day as YYYY-MM-DD."
        return default
