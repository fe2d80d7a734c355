"""Monthly invoices per tenant: read (open ones are computed, closed ones stored) and close."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from starlette.responses import Response

from billing import invoices
from gateway import downloads
from gateway.deps import SessionDep
from gateway.errors import APIError, bad_request, not_found
from gateway.schemas.admin import Id
from gateway.schemas.usage import InvoiceOut, Period
from tenancy import tenants

router = APIRouter(prefix="/tenants", tags=["admin"])
InvoiceFormat = Annotated[Literal["json", "csv"], Query(alias="format")]


@router.get("/{tenant_id}/invoices/{period}", response_model=InvoiceOut)
async def get_invoice(tenant_id: Id, period: Period, session: SessionDep,
                      fmt: InvoiceFormat = "json") -> Response:
    """The same period always answers the same bytes until usage changes it; once closed,
    forever."""
    await _known_tenant(session, tenant_id)
    view = await invoices.get_invoice(session, tenant_id=tenant_id, period=period)
    return downloads.invoice(view, fmt)


@router.post("/{tenant_id}/invoices/{period}/close", response_model=InvoiceOut)
async def close_invoice(tenant_id: Id, period: Period, session: SessionDep) -> Response:
    """Freeze a finished month: 400 for the current or a future one, 409 if already closed."""
    await _known_tenant(session, tenant_id)
    try:
        view = await invoices.close_invoice(session, tenant_id=tenant_id, period=period)
    except invoices.PeriodNotOver as exc:
        raise bad_request(str(exc), param="period", code="period_not_over") from None
    except invoices.AlreadyClosed as exc:
        raise APIError(409, str(exc), code="invoice_closed") from None
    return downloads.invoice(view, "json")


async def _known_tenant(session: SessionDep, tenant_id: str) -> None:
    if await tenants.get_tenant(session, tenant_id=tenant_id) is None:
        raise not_found(f"No tenant with id '{tenant_id}'.")

