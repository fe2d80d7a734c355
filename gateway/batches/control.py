"""What the API's and the console's routes do to a batch's row outside the worker: its
completion window's end when it is created, and a cancel (which the worker running the batch
notices)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.batches.worker import BatchWorker
from tenancy.batches import Batch
from tenancy.models import utcnow

# What a cancel moves to "cancelling"; a batch already cancelling (or cancelled) stays so.
CANCELLABLE = ("validating", "in_progress")


async def request_cancel(session: AsyncSession, *, row: Batch, worker: BatchWorker | None
                         ) -> bool:
    """Cancel `row` for the API and the console alike: validating or in_progress ->
    cancelling (in the database, so whichever process holds the batch notices at its next
    checkpoint), and this process's worker told at once. No new line starts, those in flight
    finish, then the batch is cancelled with the output of what was done. True when the
    batch is now cancelling or cancelled (again is a no-op); False when it had already ended
    otherwise. `row` is refreshed either way."""
    await session.execute(
        update(Batch).where(Batch.id == row.id, Batch.status.in_(CANCELLABLE))
        .values(status="cancelling", cancelling_at=utcnow())
        .execution_options(synchronize_session=False))
    await session.commit()
    await session.refresh(row)
    if row.status not in ("cancelling", "cancelled"):
        return False
    if worker is not None:
        worker.cancel(row.id)
    return True


def expires_at(created_at: datetime, window: str) -> datetime:
    """The end of a batch's completion window ("24h": the only one OpenAI takes)."""
    hours = int(window.removesuffix("h"))
    return created_at + timedelta(hours=hours)

