"""Usage records, usage summaries and invoices as the admin and tenant APIs show them.

Money is integer micro-USD (`*_micros`); `*_usd` fields are the same amounts as exact decimal
strings, never floats.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BaseModel, Field

from billing.invoices import parse_period
from billing.reports import (
    DIMENSIONS,
    TENANT_DIMENSIONS,
    Report,
    metrics_dict,
    parse_group_by,
)
from gateway.schemas.admin import ModelUsageOut

_NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL
ModelName = Annotated[str, Field(min_length=1, max_length=200, pattern=_NO_NUL)]
Status = Annotated[str, Field(min_length=1, max_length=32, pattern=_NO_NUL)]
CacheHit = Annotated[str, Field(min_length=1, max_length=16, pattern=_NO_NUL)]
BatchId = Annotated[str, Field(min_length=1, max_length=40, pattern=_NO_NUL)]
Origin = Literal["live", "batch"]  # live requests, or batch lines (records with a batch_id)
Cursor = Annotated[int, Field(ge=0, le=2**63 - 1)]
PageSize = Annotated[int, Field(ge=1, le=1000)]
Order = Literal["desc", "asc"]


def _group_by(allowed: tuple[str, ...]) -> Any:
    def check(value: str) -> str:
        parse_group_by(value, allowed=allowed)
        return value

    return AfterValidator(check)


# Comma-separated dimensions, e.g. "day,model"; routes split them with `parse_group_by`.
GroupBy = Annotated[str, Field(min_length=1, max_length=100), _group_by(tuple(DIMENSIONS))]
TenantGroupBy = Annotated[str, Field(min_length=1, max_length=100),
                          _group_by(TENANT_DIMENSIONS)]


def _period(value: str) -> str:
    parse_period(value)
    return value


Period = Annotated[str, AfterValidator(_period)]


class TenantUsageRecordOut(BaseModel):
    """One request as its tenant sees it."""

    id: int
    request_id: str
    created_at: datetime
    started_at: datetime | None
    tenant_id: str
    key_id: str | None
    model: str
    adapter: str
    tier: str
    status: str
    cache_hit: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_cost_micros: int
    cached_cost_micros: int
    output_cost_micros: int
    cost_micros: int
    cost_usd: str
    queue_ms: float | None
    ttft_ms: float | None
    total_ms: float | None
    batch_id: str | None  # a batch line's batch; null for a live request
    batch_price_percent: int | None  # the share of the live price a batch line was charged


class UsageRecordOut(TenantUsageRecordOut):
    """One request, with where it ran and the price version it was charged at."""

    deployment: str
    price_id: str | None


class RecordPage(BaseModel):
    """A keyset page: pass `next` back as `after` for the following one; null at the end."""

    object: Literal["list"] = "list"
    data: list[UsageRecordOut]
    next: int | None


class TenantRecordPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantUsageRecordOut]
    next: int | None


class UsageMetricsOut(BaseModel):
    requests: int
    errors: int
    cache_hits: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_cost_micros: int
    cached_cost_micros: int
    output_cost_micros: int
    cost_micros: int
    cost_usd: str
    cache_hit_rate: float  # of requests, answered from the response cache
    error_rate: float  # of requests, not ending "ok"


class UsageGroupOut(UsageMetricsOut):
    group: dict[str, str]  # dimension -> value, e.g. {"day": "2025-03-01", "model": "m"}


class UsageSummaryOut(BaseModel):
    """Sums from the daily aggregates over whole UTC days [since, until)."""

    object: Literal["usage.summary"] = "usage.summary"
    tenant_id: str | None
    since: date | None
    until: date | None
    group_by: list[str]
    data: list[UsageGroupOut]
    totals: UsageMetricsOut

    @classmethod
    def of(cls, report: Report, *, tenant_id: str | None, **extra: Any) -> Self:
        return cls(**extra, tenant_id=tenant_id, since=report.since, until=report.until,
                   group_by=list(report.group_by),
                   data=[UsageGroupOut(group=r.group, **metrics_dict(r.metrics))
                         for r in report.rows],
                   totals=UsageMetricsOut(**metrics_dict(report.totals)))


class TenantUsageOut(UsageSummaryOut):
    """A tenant's own summary, with the per-model list earlier clients read."""

    models: list[ModelUsageOut]  # per model, as before summaries had groups


class InvoiceAmountsOut(BaseModel):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    input_cost_micros: int
    cached_cost_micros: int
    output_cost_micros: int
    cost_micros: int
    cost_usd: str
    cached_discount_micros: int  # information only: already in the costs
    cached_discount_usd: str


class InvoiceLineOut(InvoiceAmountsOut):
    model: str
    tier: str
    adapter: str


class InvoiceOut(BaseModel):
    object: Literal["invoice"] = "invoice"
    tenant_id: str
    period: str
    period_start: date
    period_end: date  # exclusive
    status: Literal["open", "closed"]
    currency: Literal["usd"] = "usd"
    closed_at: datetime | None
    lines: list[InvoiceLineOut]
    totals: InvoiceAmountsOut
    total_micros: int
    total_usd: str


def models_of(report: Report) -> list[ModelUsageOut]:
    """A report grouped by model in the older per-model shape."""
    return [ModelUsageOut(model=r.group["model"], requests=r.metrics.requests,
                          prompt_tokens=r.metrics.prompt_tokens,
                          completion_tokens=r.metrics.completion_tokens,
                          cached_tokens=r.metrics.cached_tokens,
                          cost_micros=r.metrics.cost_micros) for r in report.rows]
