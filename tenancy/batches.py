"""Persisted shapes of the Batch API: tenants' files (metadata; the bytes live on disk under
the gateway's `files_dir`) and batches (their state, counts and which process runs them).

Storage only, like `tenancy.models`: the gateway's batch worker and routes
(`gateway.batches`) own the behaviour. Every lookup is scoped to a tenant: another tenant's
id is as missing as one never issued.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    Select,
    String,
    and_,
    or_,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from tenancy.db import Base
from tenancy.models import UTCDateTime, utcnow

# What a tenant may upload, and what batches write (never uploaded).
FILE_PURPOSES = ("batch", "batch_output")
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                  "cancelling", "cancelled")
# Statuses a worker still has to move on; the rest are final.
OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
FINAL_STATUSES = tuple(s for s in BATCH_STATUSES if s not in OPEN_STATUSES)
_IdColumn = String(40)


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


class StoredFile(Base):
    """A tenant's file: an uploaded batch input, or a batch's output or error file.

    The bytes are at `<files_dir>/<tenant_id>/<id>`; deleting the row deletes them."""

    __tablename__ = "files"
    __table_args__ = (
        CheckConstraint("purpose IN ('batch', 'batch_output')", name="purpose"),
        Index("ix_files_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(_IdColumn, primary_key=True, default=new_file_id)
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(16))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Batch(Base):
    """A batch of requests read from a tenant's input file, run in the background.

    `key_id` is the key that created it: its lines are answered with that key's scopes and
    limits. `lease_owner` / `lease_until` say which gateway process runs it (a process that
    stops or dies lets its lease lapse, and another, or the same after a restart, resumes
    it from the lines not yet written to its partial output)."""

    __tablename__ = "batches"
    __table_args__ = (
        CheckConstraint(
            "status IN ('validating', 'failed', 'in_progress', 'finalizing', 'completed', "
            "'expired', 'cancelling', 'cancelled')", name="status"),
        Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(_IdColumn, primary_key=True, default=new_batch_id)
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[str] = mapped_column(String(12))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(_IdColumn)
    completion_window: Mapped[str] = mapped_column(String(8), default="24h")
    status: Mapped[str] = mapped_column(String(16), default="validating")
    output_file_id: Mapped[str | None] = mapped_column(_IdColumn)
    error_file_id: Mapped[str | None] = mapped_column(_IdColumn)
    # Why a batch failed validation: [{code, message, param, line}]
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True))
    meta: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON(none_as_null=True))
    model: Mapped[str | None] = mapped_column(String(200))  # the first line's
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    lease_owner: Mapped[str | None] = mapped_column(String(32))
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())


# --- files --------------------------------------------------------------------------------


async def get_file(session: AsyncSession, *, tenant_id: str, file_id: str) -> StoredFile | None:
    row = await session.get(StoredFile, file_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def count_files(session: AsyncSession, *, tenant_id: str) -> int:
    from sqlalchemy import func

    return int(await session.scalar(
        select(func.count()).select_from(StoredFile).where(StoredFile.tenant_id == tenant_id))
        or 0)


async def list_files(session: AsyncSession, *, tenant_id: str, purpose: str | None = None,
                     after: StoredFile | None = None, limit: int, ascending: bool = False
                     ) -> list[StoredFile]:
    """A page of the tenant's files, newest first (or oldest), after `after` if given."""
    query = select(StoredFile).where(StoredFile.tenant_id == tenant_id)
    if purpose is not None:
        query = query.where(StoredFile.purpose == purpose)
    order = (StoredFile.created_at, StoredFile.id)
    if after is not None:
        query = query.where(_past(order, (after.created_at, after.id), ascending))
    query = query.order_by(*(c.asc() if ascending else c.desc() for c in order)).limit(limit)
    return list((await session.scalars(query)).all())


async def files_in_use(session: AsyncSession, *, tenant_id: str, file_id: str) -> list[str]:
    """Batches still running that read `file_id` as their input."""
    rows = await session.scalars(select(Batch.id).where(
        Batch.tenant_id == tenant_id, Batch.input_file_id == file_id,
        Batch.status.in_(OPEN_STATUSES)))
    return list(rows.all())


# --- batches ------------------------------------------------------------------------------


async def get_batch(session: AsyncSession, *, tenant_id: str, batch_id: str) -> Batch | None:
    row = await session.get(Batch, batch_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def list_batches(session: AsyncSession, *, tenant_id: str, after: Batch | None = None,
                       limit: int) -> list[Batch]:
    """A page of the tenant's batches, newest first, after `after` if given."""
    return await _batch_page(session, select(Batch).where(Batch.tenant_id == tenant_id),
                             after=after, limit=limit)


async def list_any_batches(session: AsyncSession, *, tenant_id: str | None = None,
                           after: Batch | None = None, limit: int) -> list[Batch]:
    """The operators' view (the admin console), not a tenant's: every tenant's batches, or
    one tenant's, newest first, after `after` if given."""
    query = select(Batch)
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    return await _batch_page(session, query, after=after, limit=limit)


async def files_by_id(session: AsyncSession, *, file_ids: list[str]) -> dict[str, StoredFile]:
    """Files named by batches already read (their input, output and error files), in one
    query for a whole page of batches."""
    if not file_ids:
        return {}
    rows = await session.scalars(select(StoredFile).where(StoredFile.id.in_(set(file_ids))))
    return {row.id: row for row in rows.all()}


async def _batch_page(session: AsyncSession, query: Select[tuple[Batch]], *,
                      after: Batch | None, limit: int) -> list[Batch]:
    order = (Batch.created_at, Batch.id)
    if after is not None:
        query = query.where(_past(order, (after.created_at, after.id), False))
    query = query.order_by(*(c.desc() for c in order)).limit(limit)
    return list((await session.scalars(query)).all())


async def claimable(session: AsyncSession, *, owner: str, now: datetime, limit: int = 100
                    ) -> list[str]:
    """Open batches no live process holds (or this one already does), oldest first."""
    rows = await session.scalars(
        select(Batch.id).where(Batch.status.in_(OPEN_STATUSES), _free(owner, now))
        .order_by(Batch.created_at, Batch.id).limit(limit))
    return list(rows.all())


async def claim(session: AsyncSession, *, batch_id: str, owner: str, now: datetime,
                until: datetime) -> bool:
    """Take (or renew) the lease on an open batch; False if another process holds it."""
    result = await session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.status.in_(OPEN_STATUSES),
                            _free(owner, now))
        .values(lease_owner=owner, lease_until=until)
        .execution_options(synchronize_session=False))
    await session.commit()
    return bool(getattr(result, "rowcount", 0))


async def release(session: AsyncSession, *, owner: str, batch_ids: list[str] | None = None
                  ) -> None:
    """Give back this process's leases (all of them, or those of `batch_ids`)."""
    query = update(Batch).where(Batch.lease_owner == owner)
    if batch_ids is not None:
        query = query.where(Batch.id.in_(batch_ids))
    await session.execute(query.values(lease_owner=None, lease_until=None)
                          .execution_options(synchronize_session=False))
    await session.commit()


def _free(owner: str, now: datetime) -> Any:
    return or_(Batch.lease_owner.is_(None), Batch.lease_owner == owner,
               Batch.lease_until.is_(None), Batch.lease_until < now)


def _past(columns: tuple[Any, Any], values: tuple[Any, Any], ascending: bool) -> Any:
    """Keyset condition: rows after (`values`) in the order of `columns`."""
    first, second = columns
    a, b = values
    if ascending:
        return or_(first > a, and_(first == a, second > b))
    return or_(first < a, and_(first == a, second < b))
