"""Micro-batching for an embedding model: concurrent requests share forward passes.

One forward runs at a time, off the event loop. Rows (token id lists) that arrive while it runs
go into the next one, so a lone request waits for nothing and a busy model fills its batches;
there is no timer. A forward takes rows from the oldest request first, shortest rows of each
request first (less padding), up to a row and a padded-token budget; a request of 2048 inputs
is spread over several forwards and answered when its last row is done. A request whose caller
went away is skipped for the rows not yet run.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)
Rows = list[list[int]]
Forward = Callable[[Rows], Awaitable[np.ndarray]]  # rows -> float32 [len(rows), dim]


@dataclass(eq=False)
class _Job:
    rows: Rows
    future: asyncio.Future[np.ndarray]
    order: list[int]  # row indices, shortest first
    taken: int = 0  # rows handed to a forward so far
    done: int = 0
    out: np.ndarray | None = field(default=None, repr=False)

    @property
    def exhausted(self) -> bool:
        return self.taken >= len(self.rows)


class MicroBatcher:
    """Rows in, unit vectors out, in the rows' order. No I/O or task before the first call."""

    def __init__(self, forward: Forward, *, max_rows: int = 64,
                 max_tokens: int = 16_384) -> None:
        self._forward = forward
        self.max_rows = max_rows
        self.max_tokens = max_tokens  # rows x longest row: what a padded forward computes
        self._queue: deque[_Job] = deque()
        self._task: asyncio.Task[None] | None = None
        self.forwards = 0  # how many forwards ran (batching is observable in tests)
        self._closed = False

    @property
    def pending_rows(self) -> int:
        return sum(len(job.rows) - job.taken for job in self._queue)

    async def embed(self, rows: Rows) -> np.ndarray:
        if self._closed:
            raise RuntimeError("the embedding model is closed")
        if not rows:
            return np.zeros((0, 0), dtype=np.float32)
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        self._queue.append(_Job(rows, future, order))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="embedding-batcher")
        return await future  # cancelled with its caller: the rows not yet run are dropped

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail(list(self._queue), RuntimeError("the embedding model was closed"))

    async def _run(self) -> None:
        try:
            while self._queue:
                batch = self._take()
                if not batch:
                    continue
                try:
                    vectors = await self._forward([job.rows[i] for job, i in batch])
                except Exception as exc:  # the model failed: so does every request in it
                    logger.error("embedding forward of %d rows failed: %r", len(batch), exc)
                    self._fail(list({id(job): job for job, _ in batch}.values()), exc)
                    continue
                self.forwards += 1
                self._scatter(batch, vectors)
        finally:
            self._task = None

    def _take(self) -> list[tuple[_Job, int]]:
        """The next forward's rows: oldest request first, within both budgets."""
        batch: list[tuple[_Job, int]] = []
        longest = 0
        for job in list(self._queue):
            if job.future.done():  # the caller left
                self._queue.remove(job)
                continue
            while not job.exhausted and len(batch) < self.max_rows:
                index = job.order[job.taken]
                length = max(longest, len(job.rows[index]))
                if batch and length * (len(batch) + 1) > self.max_tokens:
                    return batch
                longest = length
                batch.append((job, index))
                job.taken += 1
            if len(batch) >= self.max_rows:
                break
        return batch

    def _scatter(self, batch: list[tuple[_Job, int]], vectors: np.ndarray) -> None:
        for (job, index), vector in zip(batch, vectors, strict=True):
            if job.future.done():
                continue
            if job.out is None:
                job.out = np.empty((len(job.rows), vectors.shape[1]), dtype=np.float32)
            job.out[index] = vector
            job.done += 1
            if job.done == len(job.rows):
                job.future.set_result(job.out)
        for job in {id(job): job for job, _ in batch}.values():
            if job.future.done() and job in self._queue:
                self._queue.remove(job)

    def _fail(self, jobs: list[_Job], exc: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)
            if job in self._queue:
                self._queue.remove(job)
