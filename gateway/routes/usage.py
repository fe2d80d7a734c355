"""Tenant self-service usage: the caller's own summary and records, nothing else.

The tenant always comes from the key; no parameter names a tenant, so another tenant's usage
cannot be asked for, and unknown query parameters are ignored.
"""

from __future__ import annotations

from fastapi import APIRouter

from billing import export, reports
from gateway.deps import SessionDep, TenantDep
from gateway.schemas.admin import Id, Timestamp
from gateway.schemas.usage import (
    BatchId,
    CacheHit,
    Cursor,
    ModelName,
    Order,
    Origin,
    PageSize,
    Status,
    TenantGroupBy,
    TenantRecordPage,
    TenantUsageOut,
    TenantUsageRecordOut,
    models_of,
)

router = APIRouter(prefix="/v1", tags=["tenant"])


@router.get("/usage")
async def own_usage_summary(
    key: TenantDep, session: SessionDep, since: Timestamp | None = None,
    until: Timestamp | None = None, group_by: TenantGroupBy = "day",
) -> TenantUsageOut:
    """Sums from the daily aggregates over whole UTC days covering [since, until), grouped by
    day, model, tier or adapter; `models` keeps the per-model list."""
    first, last = reports.day_bounds(since, until)
    await reports.one_snapshot(session)
    report = await reports.summarize(session, tenant_id=key.tenant_id, since=first,
                                     until=last, group_by=reports.parse_group_by(group_by))
    by_model = report if report.group_by == ("model",) else await reports.summarize(
        session, tenant_id=key.tenant_id, since=first, until=last, group_by=("model",))
    return TenantUsageOut.of(report, tenant_id=key.tenant_id, models=models_of(by_model))


@router.get("/usage/records")
async def own_usage_records(
    key: TenantDep, session: SessionDep, key_id: Id | None = None,
    model: ModelName | None = None, status: Status | None = None,
    cache_hit: CacheHit | None = None, since: Timestamp | None = None,
    until: Timestamp | None = None, batch_id: BatchId | None = None,
    origin: Origin | None = None, limit: PageSize = 100, after: Cursor | None = None,
    order: Order = "desc",
) -> TenantRecordPage:
    """The tenant's own records, keyset-paginated like `GET /admin/usage`."""
    filters = export.RecordFilter(tenant_id=key.tenant_id, key_id=key_id, model=model,
                                  status=status, cache_hit=cache_hit, since=since, until=until,
                                  batch_id=batch_id, origin=origin)
    page, cursor = await export.list_records(session, filters=filters, limit=limit,
                                             after=after, order=order,
                                             columns=export.TENANT_COLUMNS)
    return TenantRecordPage(data=[TenantUsageRecordOut(**row) for row in page], next=cursor)
