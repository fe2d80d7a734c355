"""OpenAI's Batch API: create, retrieve, list, cancel. Always the caller's tenant: another
tenant's batch id answers exactly like an id never issued (404). The work is done by the
batch worker (`gateway.batches.worker`); these routes only read and write the batch's row."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.batches.control import expires_at, request_cancel
from gateway.batches.endpoints import ENDPOINTS
from gateway.batches.objects import batch_json, own_file, page
from gateway.batches.worker import BatchWorker
from gateway.deps import SessionDep, TenantDep
from gateway.errors import APIError, bad_request, conflict, not_found
from tenancy import batches as rows
from tenancy.batches import Batch, new_batch_id

router = APIRouter(prefix="/v1/batches", tags=["batches"])
BATCH_ID = re.compile(r"^batch_[0-9a-f]{32}$")
WINDOWS = ("24h",)
MAX_METADATA = 16


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: Annotated[str, Field(min_length=1, max_length=64)]
    endpoint: Annotated[str, Field(max_length=64)]
    completion_window: Annotated[str, Field(max_length=16)]
    metadata: dict[Annotated[str, Field(max_length=64)],
                   Annotated[str, Field(max_length=512)]] | None = None
    # Accepted for the client's sake: outputs are kept until deleted.
    output_expires_after: dict[str, Any] | None = None


def worker_of(request: Request) -> BatchWorker | None:
    return getattr(request.app.state, "batch_worker", None)


def no_such_batch(batch_id: str, param: str = "batch_id") -> APIError:
    return not_found(f"No such Batch object: '{batch_id}'.", param=param)


async def own_batch(session: SessionDep, tenant_id: str, batch_id: str,
                    param: str = "batch_id") -> Batch:
    row = None
    if BATCH_ID.match(batch_id):
        row = await rows.get_batch(session, tenant_id=tenant_id, batch_id=batch_id)
    if row is None:
        raise no_such_batch(batch_id, param)
    return row


def shown(request: Request, row: Batch) -> dict[str, Any]:
    """The batch, with live counts where this process runs it."""
    worker = worker_of(request)
    return batch_json(row, None if worker is None else worker.progress(row.id))


@router.post("")
async def create_batch(body: BatchCreate, request: Request, key: TenantDep,
                       session: SessionDep) -> JSONResponse:
    if body.endpoint not in ENDPOINTS:
        raise bad_request(f"Batches here serve {', '.join(ENDPOINTS)}; not "
                          f"'{body.endpoint}'.", param="endpoint", code="invalid_value")
    if body.completion_window not in WINDOWS:
        raise bad_request("'completion_window' must be \"24h\".", param="completion_window",
                          code="invalid_value")
    if body.metadata is not None and len(body.metadata) > MAX_METADATA:
        raise bad_request(f"'metadata' may have at most {MAX_METADATA} keys.",
                          param="metadata", code="invalid_value")
    file = await own_file(session, key.tenant_id, body.input_file_id, "input_file_id")
    if file.purpose != "batch":
        raise bad_request("The input file must be one uploaded with purpose 'batch'.",
                          param="input_file_id", code="invalid_value")
    now = datetime.now(UTC)
    row = Batch(id=new_batch_id(), tenant_id=key.tenant_id, key_id=key.key_id,
                endpoint=body.endpoint, input_file_id=file.id,
                completion_window=body.completion_window, status="validating",
                meta=body.metadata, total=0, completed=0, failed=0, input_tokens=0,
                cached_tokens=0, output_tokens=0, created_at=now,
                expires_at=expires_at(now, body.completion_window))
    session.add(row)
    await session.commit()
    worker = worker_of(request)
    if worker is not None:
        worker.wake()
    return JSONResponse(batch_json(row))


@router.get("")
async def list_batches(request: Request, key: TenantDep, session: SessionDep,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20,
                       after: Annotated[str | None, Query(max_length=64)] = None
                       ) -> JSONResponse:
    cursor = None if after is None else await own_batch(session, key.tenant_id, after, "after")
    found = await rows.list_batches(session, tenant_id=key.tenant_id, after=cursor,
                                    limit=limit + 1)
    return JSONResponse(page([shown(request, b) for b in found[:limit]],
                             has_more=len(found) > limit))


@router.get("/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request, key: TenantDep,
                         session: SessionDep) -> JSONResponse:
    return JSONResponse(shown(request, await own_batch(session, key.tenant_id, batch_id)))


@router.post("/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, key: TenantDep,
                       session: SessionDep) -> JSONResponse:
    """validating or in_progress -> cancelling (`request_cancel`, which the console uses
    too). Cancelling again is a no-op; a batch that already ended is a 409."""
    row = await own_batch(session, key.tenant_id, batch_id)
    if not await request_cancel(session, row=row, worker=worker_of(request)):
        raise conflict(f"Cannot cancel a batch with status '{row.status}'.")
    return JSONResponse(shown(request, row))
