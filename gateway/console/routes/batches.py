"""Batches of the Batch API, every tenant's or one tenant's: status, counts, files and tokens
so far, newest first in keyset pages; an open batch can be cancelled.

Reads go through `tenancy.batches` and the cancel through `gateway.batches.control
.request_cancel`, exactly what `/v1/batches/{id}/cancel` calls, so a console cancel is an API
cancel. The console is the operators' view, so the list spans tenants; a cancel still names
the batch's own tenant in its URL, and any other tenant's id answers 404, as the API does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from fastapi import Request
from starlette.responses import RedirectResponse, Response

from gateway.batches.control import CANCELLABLE, request_cancel
from gateway.batches.objects import Progress
from gateway.batches.worker import BatchWorker
from gateway.console.auth import AdminSession, SignedIn
from gateway.console.forms import FormReader
from gateway.console.render import is_htmx, page
from gateway.console.routing import console_router
from gateway.deps import SessionDep
from tenancy import batches as rows
from tenancy import tenants
from tenancy.batches import Batch, StoredFile

router = console_router()
PAGE_SIZE = 50
MAX_PAGE = 100
REFRESH_SECONDS = 5
_ID_MAX = 64  # longer than any tenant or batch id: never looked up


@dataclass(frozen=True, slots=True)
class BatchView:
    """One batch as a row of the table: the stored row, with the counts this process has
    fresher than the row (a running batch's are written every checkpoint), and its files."""

    row: Batch
    tenant_name: str
    counts: Progress
    input_file: StoredFile | None
    output_file: StoredFile | None
    error_file: StoredFile | None

    @property
    def finished_at(self) -> datetime | None:
        """When it reached a final status (None while open)."""
        r = self.row
        return r.completed_at or r.failed_at or r.expired_at or r.cancelled_at

    @property
    def cancellable(self) -> bool:
        return self.row.status in CANCELLABLE

    @property
    def records_query(self) -> str:
        """The usage export's query for this batch's lines: the days they can fall on."""
        first = self.row.created_at.astimezone(UTC).date()
        last = (self.finished_at or datetime.now(UTC)).astimezone(UTC).date()
        return urlencode({"tenant_id": self.row.tenant_id, "batch_id": self.row.id,
                          "since": first.isoformat(), "until": max(first, last).isoformat()})


@router.get("/batches")
async def batches_page(request: Request, admin: AdminSession, session: SessionDep,
                       tenant_id: str = "", after: str = "", limit: int = PAGE_SIZE
                       ) -> Response:
    """`tenant_id` narrows to one tenant; `after` is the last batch of the page before."""
    return await _page(request, admin, session, tenant_id=tenant_id or None,
                       after=after or None, limit=max(1, min(limit, MAX_PAGE)))


@router.post("/tenants/{tenant_id}/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, tenant_id: str, batch_id: str, admin: AdminSession,
                       session: SessionDep) -> Response:
    """The API's cancel, for the batch of this tenant only. The form says which list it came
    from (`view_tenant_id`, `view_after`), so the answer shows that list again."""
    form = FormReader(await request.form())
    view = {"tenant_id": form.raw("view_tenant_id")[:_ID_MAX] or None,
            "after": form.raw("view_after")[:_ID_MAX] or None}
    row = None
    if len(tenant_id) <= _ID_MAX and len(batch_id) <= _ID_MAX:
        row = await rows.get_batch(session, tenant_id=tenant_id, batch_id=batch_id)
    if row is None:
        return page(request, "error.html", {
            "admin": admin, "title": "Not found", "nav": "batches",
            "message": f"Tenant '{tenant_id}' has no batch '{batch_id}'."},
            fragment="_error.html", status_code=404)
    if await request_cancel(session, row=row, worker=_worker(request)):
        if not is_htmx(request):
            return RedirectResponse(_list_url(**view), status_code=303)
        notice = (f"Batch {row.id} is cancelled." if row.status == "cancelled" else
                  f"Batch {row.id} is cancelling: no new line starts; those in flight "
                  "finish first.")
        return await _page(request, admin, session, **view, limit=PAGE_SIZE, notice=notice)
    return await _page(request, admin, session, **view, limit=PAGE_SIZE, status_code=409,
                       error=f"Cannot cancel a batch with status '{row.status}'.")


def _worker(request: Request) -> BatchWorker | None:
    """This process's batch worker (None when `batch_worker` is off)."""
    worker: BatchWorker | None = getattr(request.app.state, "batch_worker", None)
    return worker


def _list_url(*, tenant_id: str | None, after: str | None, limit: int = PAGE_SIZE) -> str:
    query = {k: v for k, v in (("tenant_id", tenant_id), ("after", after)) if v}
    if limit != PAGE_SIZE:
        query["limit"] = str(limit)
    return "/console/batches" + (f"?{urlencode(query)}" if query else "")


async def _page(request: Request, admin: SignedIn, session: SessionDep, *,
                tenant_id: str | None, after: str | None, limit: int,
                notice: str | None = None, error: str | None = None,
                status_code: int = 200) -> Response:
    """The list: the tenants (for names and the filter), a page of batches and their files:
    three queries however long the page."""
    listed = await tenants.list_tenants(session)
    names = {t.id: t.name for t in listed}
    if tenant_id is not None and tenant_id not in names:
        return page(request, "error.html", {
            "admin": admin, "title": "Not found", "nav": "batches",
            "message": f"No tenant with id '{tenant_id}'."}, status_code=404)
    # An unknown cursor (a batch deleted with its tenant) starts again from the newest.
    cursor = None if after is None or len(after) > _ID_MAX else await session.get(Batch, after)
    found = await rows.list_any_batches(session, tenant_id=tenant_id, after=cursor,
                                        limit=limit + 1)
    shown = found[:limit]
    files = await rows.files_by_id(session, file_ids=[
        f for b in shown for f in (b.input_file_id, b.output_file_id, b.error_file_id) if f])
    worker = _worker(request)
    views = [_view(b, names, files, worker) for b in shown]
    context: dict[str, Any] = {
        "admin": admin, "title": "Batches", "nav": "batches", "batches": views,
        "tenants": listed, "tenant": None if tenant_id is None else next(
            t for t in listed if t.id == tenant_id),
        "tenant_id": tenant_id or "", "after": cursor.id if cursor is not None else "",
        "older": _list_url(tenant_id=tenant_id, after=shown[-1].id, limit=limit)
        if len(found) > limit else None,
        "newest": _list_url(tenant_id=tenant_id, after=None, limit=limit)
        if cursor is not None else None,
        "refresh_url": _list_url(tenant_id=tenant_id, after=cursor.id if cursor else None,
                                 limit=limit),
        "refresh_s": REFRESH_SECONDS, "notice": notice, "error": error,
    }
    return page(request, "batches.html", context, fragment="_batches_panel.html",
                status_code=status_code)


def _view(row: Batch, names: dict[str, str], files: dict[str, StoredFile],
          worker: BatchWorker | None) -> BatchView:
    live = None if worker is None else worker.progress(row.id)
    counts = live or Progress(row.completed, row.failed, row.input_tokens, row.cached_tokens,
                              row.output_tokens)

    def file(file_id: str | None) -> StoredFile | None:
        return None if file_id is None else files.get(file_id)

    return BatchView(row, names.get(row.tenant_id, row.tenant_id), counts,
                     file(row.input_file_id), file(row.output_file_id), file(row.error_file_id))
