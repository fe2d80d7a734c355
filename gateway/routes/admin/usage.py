"""Usage for operators: raw records (keyset pages and streamed exports) and summaries from the
daily aggregates, across tenants."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query
from starlette.responses import StreamingResponse

from billing import export, reports
from gateway import downloads
from gateway.deps import SessionDep, StateDep
from gateway.errors import not_found
from gateway.schemas.admin import Id, Timestamp, UsageOut
from gateway.schemas.usage import (
    BatchId,
    CacheHit,
    Cursor,
    GroupBy,
    ModelName,
    Order,
    Origin,
    PageSize,
    RecordPage,
    Status,
    UsageRecordOut,
    UsageSummaryOut,
    models_of,
)
from tenancy import tenants

router = APIRouter(prefix="/usage", tags=["admin"])


def record_filter(
    tenant_id: Id | None = None, key_id: Id | None = None, model: ModelName | None = None,
    status: Status | None = None, cache_hit: CacheHit | None = None,
    since: Timestamp | None = None, until: Timestamp | None = None,
    batch_id: BatchId | None = None, origin: Origin | None = None,
) -> export.RecordFilter:
    """Every filter narrows; `since`/`until` bound `created_at` as [since, until);
    `batch_id` keeps one batch's lines, `origin` live requests or batch lines."""
    return export.RecordFilter(tenant_id=tenant_id, key_id=key_id, model=model, status=status,
                               cache_hit=cache_hit, since=since, until=until,
                               batch_id=batch_id, origin=origin)


FilterDep = Annotated[export.RecordFilter, Depends(record_filter)]


@router.get("")
async def list_usage(
    session: SessionDep, filters: FilterDep, limit: PageSize = 100,
    after: Cursor | None = None, order: Order = "desc",
) -> RecordPage:
    """Records by id, newest first unless `order=asc`; `after` is the previous page's `next`.
    Keyset pagination: a page costs the same however deep it is, and rows written meanwhile
    never shift it."""
    page, cursor = await export.list_records(session, filters=filters, limit=limit,
                                             after=after, order=order)
    return RecordPage(data=[UsageRecordOut(**row) for row in page], next=cursor)


@router.get("/export")
async def export_usage(
    state: StateDep, filters: FilterDep,
    fmt: Annotated[export.ExportFormat, Query(alias="format")] = "csv",
) -> StreamingResponse:
    """Every matching record, oldest first, streamed from a server-side cursor: memory stays
    flat for any range."""
    return await downloads.usage_export(state.sessionmaker, filters, fmt)


@router.get("/summary")
async def usage_summary(
    session: SessionDep, tenant_id: Id | None = None, model: ModelName | None = None,
    since: Timestamp | None = None, until: Timestamp | None = None, group_by: GroupBy = "day",
) -> UsageSummaryOut:
    """Dashboards: sums per group from the daily aggregates, over whole UTC days covering
    [since, until)."""
    first, last = reports.day_bounds(since, until)
    report = await reports.summarize(session, tenant_id=tenant_id, since=first, until=last,
                                     group_by=reports.parse_group_by(group_by), model=model)
    return UsageSummaryOut.of(report, tenant_id=tenant_id)


@router.get("/{tenant_id}")
async def tenant_usage(
    tenant_id: Id, session: SessionDep, since: Timestamp | None = None,
    until: Timestamp | None = None,
) -> UsageOut:
    """Per-model sums of one tenant (whole UTC days covering [since, until))."""
    if await tenants.get_tenant(session, tenant_id=tenant_id) is None:
        raise not_found(f"No tenant with id '{tenant_id}'.")
    first, last = reports.day_bounds(since, until)
    report = await reports.summarize(session, tenant_id=tenant_id, since=first, until=last,
                                     group_by=("model",))
    return UsageOut(tenant_id=tenant_id, since=since, until=until, models=models_of(report))
