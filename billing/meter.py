"""Usage records leave the hot path: the request appends, a background task writes batches.

This is the first cut; the billing issue makes it crash-safe with an outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenancy import service

logger = logging.getLogger(__name__)
MAX_BATCH = 500
MAX_PENDING = 100_000


class UsageMeter:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], *,
                 flush_interval_s: float = 0.5) -> None:
        self._sessionmaker = sessionmaker
        self._interval = flush_interval_s
        self._pending: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._flushing = asyncio.Lock()  # two flushes at once would write a batch twice

    def record(self, **fields: Any) -> None:
        """Never blocks and never raises: metering must not fail a request."""
        if len(self._pending) >= MAX_PENDING:
            logger.error("usage backlog full; dropping the oldest record")
            self._pending.pop(0)
        self._pending.append(fields)
        if len(self._pending) >= MAX_BATCH:
            self._wake.set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-meter")

    async def stop(self) -> None:
        """Let a write in progress finish (cancelling it could leave the database locked),
        then write the rest."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()

    async def flush(self) -> int:
        """Write everything pending. Connection trouble raises (retry later); a record the
        database refuses is logged and skipped, so one bad record never blocks the rest."""
        async with self._flushing:
            return await self._flush_pending()

    async def _flush_pending(self) -> int:
        written = 0
        while self._pending:
            batch = self._pending[:MAX_BATCH]
            try:
                await self._write(batch)
            except (OperationalError, InterfaceError):
                raise
            except DBAPIError:
                batch = await self._write_one_by_one(batch)
            del self._pending[: len(batch)]
            written += len(batch)
        return written

    async def _write(self, records: list[dict[str, Any]]) -> None:
        async with self._sessionmaker() as session:
            await service.record_usage(session, records=records)

    async def _write_one_by_one(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for record in batch:
            try:
                await self._write([record])
            except (OperationalError, InterfaceError):
                raise
            except DBAPIError as exc:
                logger.error("usage record %s refused by the database (%s); skipped",
                             record.get("request_id"), type(exc.orig).__name__)
        return batch

    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            if self._stopping:
                return
            try:
                await self.flush()
            except (SQLAlchemyError, OSError) as exc:
                logger.warning("usage flush failed (%s); will retry", type(exc).__name__)
