"""Usage records leave the hot path: the request appends, a background task writes batches.

Each record goes first to the outbox (`billing.outbox`, a local write-ahead log that survives
the death of the process), then to an in-memory batch. A background task writes batches with
`billing.ledger.write_batch` (idempotent on `request_id`) and then lets the outbox delete the
segments whose records are all committed. `start` first replays segments that dead processes
left behind; `stop` (the SIGTERM path) writes everything and leaves no segment of its own.
With the database down, records wait in memory and on disk and are retried; requests never
wait for the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections import deque
from pathlib import Path
from typing import Any

from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
    StatementError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.ledger import write_batch
from billing.outbox import Outbox, Segment

logger = logging.getLogger(__name__)
MAX_BATCH = 500
MAX_PENDING = 100_000
# Connection trouble and timeouts: keep the records and retry later.
_RETRYABLE = (SQLAlchemyError, OSError)
# The database (or the ledger) refuses the data itself: retrying would never succeed.
_REFUSED = (DBAPIError, StatementError, LookupError, TypeError, ValueError, AttributeError)
_CONNECTION = (OperationalError, InterfaceError, DisconnectionError, PoolTimeout, OSError)

_Entry = tuple[dict[str, Any], Segment | None]


class UsageMeter:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], *,
                 flush_interval_s: float = 0.5, outbox_dir: Path | None = None,
                 max_batch: int = MAX_BATCH, max_pending: int = MAX_PENDING,
                 fsync_interval_s: float | None = None) -> None:
        self._sessionmaker = sessionmaker
        self._interval = flush_interval_s
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._fsync_interval = fsync_interval_s
        self.outbox = Outbox(outbox_dir) if outbox_dir is not None else None
        self._pending: deque[_Entry] = deque()
        self._leftovers: list[Segment] = []
        self._task: asyncio.Task[None] | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._flushing = asyncio.Lock()  # two flushes at once would write a batch twice

    def record(self, **fields: Any) -> None:
        """Never blocks and never raises: metering must not fail a request. Once this returns,
        the record survives a kill of the process (when the outbox is writable)."""
        segment = self.outbox.append(fields) if self.outbox is not None else None
        if len(self._pending) >= self._max_pending:
            old, old_segment = self._pending.popleft()
            # On disk it stays uncommitted, so the next start replays it.
            logger.error("usage backlog full; oldest record %s dropped from memory%s",
                         old.get("request_id"),
                         " (kept in the outbox)" if old_segment is not None else "")
        self._pending.append((fields, segment))
        if len(self._pending) >= self._max_batch:
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        """Claim and replay what dead processes left in the outbox, then flush periodically.
        A database that is down delays the replay to the background task; it never fails
        the start."""
        self._stopping = False
        if self.outbox is not None:
            try:
                self._leftovers = self.outbox.claim_leftovers()
            except OSError as exc:
                logger.error("usage outbox %s unusable (%s)", self.outbox.directory, exc)
            try:
                await self.flush()
            except _RETRYABLE as exc:
                logger.warning("usage replay failed (%s); will retry", type(exc).__name__)
        self._task = asyncio.create_task(self._run(), name="usage-meter")
        if self.outbox is not None and self._fsync_interval:
            self._sync_task = asyncio.create_task(self._sync(self.outbox, self._fsync_interval),
                                                  name="usage-outbox-fsync")

    async def stop(self) -> None:
        """Let a write in progress finish (cancelling it could leave the database locked),
        write the rest, and delete this process's outbox segments. What the database does not
        take stays in the outbox for the next start."""
        self._stopping = True
        self._wake.set()
        if self._sync_task is not None:
            self._sync_task.cancel()
        tasks = [t for t in (self._task, self._sync_task) if t is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._sync_task = None
        try:
            await self.flush()
        except _RETRYABLE as exc:
            logger.error("usage flush on stop failed (%s)", type(exc).__name__)
        finally:
            lost = sum(1 for _, segment in self._pending if segment is None)
            if lost:
                logger.error("%d usage records were in memory only and are lost", lost)
            if self.outbox is not None:
                if self._fsync_interval:
                    await self.outbox.sync()
                left = self.outbox.close()
                self._leftovers.clear()
                if left:
                    logger.error("%d usage records stay in %s for the next start", left,
                                 self.outbox.directory)

    async def flush(self) -> int:
        """Write leftovers, then everything pending. Connection trouble raises (retry later);
        a record the database refuses is logged and skipped, so one bad record never blocks
        the rest. Returns how many records were handled."""
        async with self._flushing:
            done = await self._replay_leftovers()
            if self.outbox is not None:
                self.outbox.seal()
            return done + await self._flush_pending()

    async def _replay_leftovers(self) -> int:
        done = 0
        while self._leftovers and self.outbox is not None:
            segment = self._leftovers[0]
            records = self.outbox.read(segment)
            for start in range(0, len(records), self._max_batch):
                await self._write_batch(records[start:start + self._max_batch])
            self.outbox.discard(segment)
            self._leftovers.pop(0)
            logger.info("replayed %d usage records from %s", len(records), segment.path.name)
            done += len(records)
        return done

    async def _flush_pending(self) -> int:
        # Only what is pending now (all of it when stopping): records that arrive while a
        # batch is being written wait for the next tick. Draining "while anything is pending"
        # kept a loaded gateway writing batches of one or two records back to back, each
        # paying a whole transaction (several ms of CPU), a third of its CPU.
        left = sys.maxsize if self._stopping else len(self._pending)
        done = 0
        while left > 0 and self._pending:
            # Taken out first: `record` may drop the oldest pending entries meanwhile.
            batch = [self._pending.popleft()
                     for _ in range(min(self._max_batch, left, len(self._pending)))]
            left -= len(batch)
            try:
                await self._write_batch([record for record, _ in batch])
            except BaseException:
                self._pending.extendleft(reversed(batch))
                raise
            if self.outbox is not None:
                self.outbox.commit([segment for _, segment in batch])
            done += len(batch)
        return done

    async def _write_batch(self, records: list[dict[str, Any]]) -> None:
        try:
            await self._write(records)
        except _CONNECTION:
            raise
        except _REFUSED:
            await self._write_one_by_one(records)

    async def _write(self, records: list[dict[str, Any]]) -> None:
        async with self._sessionmaker() as session:
            await write_batch(session, records=records)

    async def _write_one_by_one(self, batch: list[dict[str, Any]]) -> None:
        for record in batch:
            try:
                await self._write([record])
            except _CONNECTION:
                raise
            except _REFUSED as exc:
                cause = getattr(exc, "orig", None) or exc
                logger.error("usage record %s refused (%s); skipped",
                             record.get("request_id"), type(cause).__name__)

    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            if self._stopping:
                return
            try:
                await self.flush()
            except _RETRYABLE as exc:
                logger.warning("usage flush failed (%s); will retry", type(exc).__name__)
            except Exception:  # a bug must not end metering: the records stay, retried later
                logger.exception("usage flush crashed; will retry")

    @staticmethod
    async def _sync(outbox: Outbox, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await outbox.sync()
