"""Responses kept for the OpenAI Responses API (`store`, the default): per tenant, so that
`GET` / `DELETE /v1/responses/{id}` and `previous_response_id` find them, and another tenant
never does (every lookup is by id *and* tenant).

A row holds the response as it was answered, its own input items, and the conversation before
them (the items of the responses it continued, flattened), so a continuation needs one read and
keeps working after a response earlier in the chain is deleted.

Writes leave the answer's path (`Keeper`): a finished answer is queued and written in the
background, the answers queued within `GROUP_S` sharing one transaction (a group commit), so
storing costs the client no database round trip and a busy gateway few transactions. Reads
stay exact: on the replica that answered, a read of a response still queued is answered from
the queue (a deletion waits for its write); on another replica, a miss on an id minted in
the last `FRESH_S` seconds (the id carries its time) is read again until then, so a client
that saw a response complete finds it wherever it asks next. A write still queued when the
process dies is lost (the answer was delivered; only its stored copy is missing).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, String, delete, insert, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Mapped, mapped_column

from tenancy.db import Base
from tenancy.models import UTCDateTime, utcnow

logger = logging.getLogger(__name__)

RESPONSE_ID_LENGTH = 64
FRESH_S = 2.0  # how long another replica looks again for a new response not yet written
_RETRY_S = 0.05
# A write waits this long for others to share its transaction: a flush costs 0.5-0.9 ms of
# CPU on SQLite whatever its size, plus about 28 us a row (16 rows a flush: 83 us a response;
# 64: 36 us). Reads on this replica never wait for it (the queue answers them).
GROUP_S = 0.05
_TIME_HEX = 12  # an id's first hex digits: its creation time in ms


def new_response_id(now: float | None = None) -> str:
    """`resp_` + 32 hex: the creation time in ms (12) and 80 random bits (20)."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"resp_{ms:0{_TIME_HEX}x}{os.urandom(10).hex()}"


def minted_at(response_id: str) -> float | None:
    """When an id of ours was made (seconds), or None for any other string."""
    digits = response_id.removeprefix("resp_")[:_TIME_HEX]
    if len(digits) != _TIME_HEX or not response_id.startswith("resp_"):
        return None
    try:
        return int(digits, 16) / 1000
    except ValueError:
        return None


class StoredResponse(Base):
    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(RESPONSE_ID_LENGTH), primary_key=True)  # resp_...
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))  # completed, incomplete
    previous_response_id: Mapped[str | None] = mapped_column(String(RESPONSE_ID_LENGTH))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the Response object, as answered
    input_items: Mapped[list[Any]] = mapped_column(JSON)  # this response's own input
    history: Mapped[list[Any]] = mapped_column(JSON)  # the items before them
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


async def find(session: AsyncSession, *, response_id: str, tenant_id: str
               ) -> StoredResponse | None:
    """The tenant's response with this id (None: no such response, or another tenant's)."""
    return (await session.execute(select(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id))
    ).scalar_one_or_none()


async def remove(session: AsyncSession, *, response_id: str, tenant_id: str) -> bool:
    """Delete the tenant's response; False if it had none by that id."""
    result = await session.execute(delete(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id))
    await session.commit()
    return bool(getattr(result, "rowcount", 0))


# ---- writes off the answer's path, reads that see them -------------------------------------

@dataclass
class _Queued:
    values: dict[str, Any]  # a `responses` row's columns
    written: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Writes:
    queue: list[_Queued] = field(default_factory=list)
    pending: dict[str, _Queued] = field(default_factory=dict)  # by response id
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    scheduled: bool = False  # a flush is on its way: later answers join it


# One queue per database (its session factory): an app's, however many apps share a process.
_writes: weakref.WeakKeyDictionary[async_sessionmaker[AsyncSession], _Writes] = (
    weakref.WeakKeyDictionary())


class Keeper:
    """Stored responses of one database, as the gateway uses them: `keep` queues a write and
    returns at once; `find` and `remove` see every write this process queued, and for fresh ids
    wait briefly for other replicas' writes."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession],
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self._sessionmaker = sessionmaker
        self._spawn = spawn
        writes = _writes.get(sessionmaker)
        if writes is None:  # the first Keeper of this database (a Keeper is made per use)
            writes = _writes[sessionmaker] = _Writes()
        self._writes = writes

    def keep(self, *, response_id: str, tenant_id: str, status: str,
             previous_response_id: str | None, body: dict[str, Any], input_items: list[Any],
             history: list[Any]) -> None:
        queued = _Queued({
            "id": response_id, "tenant_id": tenant_id, "status": status,
            "previous_response_id": previous_response_id, "body": body,
            "input_items": input_items, "history": history, "created_at": utcnow()})
        writes = self._writes
        writes.pending[response_id] = queued
        writes.queue.append(queued)
        if not writes.scheduled:
            writes.scheduled = True
            self._spawn(self._flush())

    async def _flush(self) -> None:
        """After `GROUP_S`, write what is queued in one transaction (a read of a queued
        response waits for it, so nothing is seen missing meanwhile)."""
        writes = self._writes
        await asyncio.sleep(GROUP_S)
        async with writes.lock:
            writes.scheduled = False  # from here, a new answer schedules the next flush
            batch, writes.queue = writes.queue, []
            if not batch:
                return
            try:
                # a Core executemany on the table: the ORM's unit of work cost about as much
                # CPU as the rest of a stored response's request
                async with self._sessionmaker() as session:
                    conn = await session.connection()
                    await conn.execute(insert(StoredResponse.__table__),
                                       [q.values for q in batch])
                    await session.commit()
            except Exception:
                logger.warning("%d stored responses were not written", len(batch),
                               exc_info=True)
            finally:
                for queued in batch:
                    writes.pending.pop(queued.values["id"], None)
                    queued.written.set()

    async def _written(self, response_id: str, tenant_id: str) -> None:
        queued = self._writes.pending.get(response_id)
        if queued is not None and queued.values["tenant_id"] == tenant_id:
            await asyncio.wait_for(queued.written.wait(), timeout=30)

    async def find(self, response_id: str, tenant_id: str) -> StoredResponse | None:
        """The tenant's response (None: no such response, or another tenant's): one still
        queued here from the queue (a continuation waits for no write), else from the
        database."""
        queued = self._writes.pending.get(response_id)
        if queued is not None and queued.values["tenant_id"] == tenant_id:
            return StoredResponse(**queued.values)  # a copy of the row, in no session
        minted = minted_at(response_id)
        deadline = 0.0 if minted is None else min(minted + FRESH_S, time.time() + FRESH_S)
        while True:
            async with self._sessionmaker() as session:
                found = await find(session, response_id=response_id, tenant_id=tenant_id)
            if found is not None or time.time() >= deadline:
                return found
            await asyncio.sleep(_RETRY_S)

    async def remove(self, response_id: str, tenant_id: str) -> bool:
        await self._written(response_id, tenant_id)  # else the write would bring it back
        if await self.find(response_id, tenant_id) is None:
            return False
        async with self._sessionmaker() as session:
            return await remove(session, response_id=response_id, tenant_id=tenant_id)
