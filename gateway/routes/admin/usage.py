"""Usage per tenant (billing exports come with the billing issue)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import SessionDep
from gateway.errors import not_found
from gateway.schemas.admin import Id, ModelUsageOut, Timestamp, UsageOut
from tenancy import service

router = APIRouter(prefix="/usage", tags=["admin"])


@router.get("/{tenant_id}")
async def tenant_usage(
    tenant_id: Id, session: SessionDep, since: Timestamp | None = None,
    until: Timestamp | None = None,
) -> UsageOut:
    if await service.get_tenant(session, tenant_id=tenant_id) is None:
        raise not_found(f"No tenant with id '{tenant_id}'.")
    rows = await service.usage_summary(session, tenant_id=tenant_id, since=since, until=until)
    return UsageOut(tenant_id=tenant_id, since=since, until=until,
                    models=[ModelUsageOut.model_validate(r) for r in rows])
