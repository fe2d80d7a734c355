"""Micro-batching for an embedding model: concurrent requests share forward passes, and
tenants share the model fairly.

One forward runs at a time, off the event loop. Rows (token id lists) that arrive while it runs
go into the next one, so a lone request waits for nothing and a busy model fills its batches;
there is no timer. A forward holds at most `max_rows` rows and `max_tokens` padded tokens (rows
x longest row), so a request of 2048 inputs is spread over many forwards and answered when its
last row is done.

Which rows go into a forward is the engine's weighted fair share (`workers.engine.fair_share`),
row by row: each tenant has a virtual token counter that grows by the tokens of its rows handed
to a forward, divided by its plan's weight, and the next row is always the least-served
tenant's. A tenant that arrives while others are busy starts level with the least served
(first among equals; idle time is not banked), so its one-string request goes into the very
next forward however much another tenant has queued. Within a tenant: the more urgent request
(lower priority), then the older; within a request, its shortest rows first (less padding).

What a request has cost is reported as it runs (`progress`: the tokens of its rows computed);
a request whose caller went away is skipped for the rows not yet run, and pays for those
already handed to a forward (a forward cannot be stopped: they are computed all the same).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)
Rows = list[list[int]]
Forward = Callable[[Rows], Awaitable[np.ndarray]]  # rows -> float32 [len(rows), dim]
# The tokens of a request's rows computed so far, and whether its caller has left (then the
# count includes the rows of a forward still running).
Progress = Callable[[int, bool], None]


@dataclass(eq=False)
class _Job:
    rows: Rows
    future: asyncio.Future[np.ndarray]
    order: list[int]  # row indices, shortest first
    tenant: str
    weight: float
    rank: tuple[int, int]  # (priority, arrival): a tenant's jobs run in this order
    progress: Progress | None = None
    taken: int = 0  # rows handed to a forward so far
    done: int = 0  # rows computed
    taken_tokens: int = 0
    done_tokens: int = 0
    reported: int = 0  # the tokens last given to `progress`
    left: bool = False  # no longer counts as the tenant's work (answered, failed or gone)
    out: np.ndarray | None = field(default=None, repr=False)

    @property
    def exhausted(self) -> bool:
        return self.taken >= len(self.rows)

    def report(self, tokens: int, *, gone: bool = False) -> None:
        if tokens > self.reported:
            self.reported = tokens
            if self.progress is not None:
                try:
                    self.progress(tokens, gone)
                except Exception:  # a caller's hook never stops the forwards of others
                    logger.exception("embedding progress callback failed")


class MicroBatcher:
    """Rows in, unit vectors out, in the rows' order. No I/O or task before the first call."""

    def __init__(self, forward: Forward, *, max_rows: int = 64,
                 max_tokens: int = 4096) -> None:
        self._forward = forward
        self.max_rows = max_rows
        self.max_tokens = max_tokens  # rows x longest row: what a padded forward computes
        self._waiting: dict[str, list[_Job]] = {}  # tenant -> its jobs with rows not yet taken
        self._active: Counter[str] = Counter()  # tenant -> its jobs not yet answered
        self._live: dict[int, _Job] = {}  # every job not yet answered, in flight included
        self.counters: dict[str, float] = {}  # tenant -> tokens handed to forwards / weight
        self.tokens: Counter[str] = Counter()  # tenant -> tokens computed (unweighted)
        self._arrivals = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self.forwards = 0  # how many forwards ran (batching is observable in tests)
        self._closed = False

    @property
    def pending_rows(self) -> int:
        return sum(len(job.rows) - job.taken for jobs in self._waiting.values() for job in jobs
                   if not job.future.done())

    async def embed(self, rows: Rows, *, tenant: str = "", weight: float = 1.0,
                    priority: int = 0, progress: Progress | None = None) -> np.ndarray:
        """The rows' vectors. `tenant` and `weight` place the request in the fair share (set
        from the key and its plan, never from the client); `progress` hears the tokens of its
        rows computed, as forwards finish, and once more if the caller leaves."""
        if self._closed:
            raise RuntimeError("the embedding model is closed")
        if not rows:
            return np.zeros((0, 0), dtype=np.float32)
        loop = asyncio.get_running_loop()
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        job = _Job(rows, loop.create_future(), order, tenant,
                   weight if weight > 0 and math.isfinite(weight) else 1.0,
                   (priority, next(self._arrivals)), progress)
        self._arrive(job)
        if self._task is None:
            self._task = loop.create_task(self._run(), name="embedding-batcher")
        try:
            return await job.future
        except asyncio.CancelledError:  # the caller left: its rows not yet taken are dropped
            job.report(job.taken_tokens, gone=True)  # those in a forward are computed anyway
            self._leave(job)
            raise

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail(list(self._live.values()), RuntimeError("the embedding model was closed"))

    def _arrive(self, job: _Job) -> None:
        tenant = job.tenant
        if self._active[tenant] == 0:  # level with the least served: idle time is not banked
            others = [self.counters.get(t, 0.0) for t, n in self._active.items()
                      if n > 0 and t != tenant]
            own = self.counters.get(tenant, 0.0)
            if others and own < min(others):
                own = math.nextafter(min(others), -math.inf)
            self.counters[tenant] = own
        self._active[tenant] += 1
        self._live[id(job)] = job
        waiting = self._waiting.setdefault(tenant, [])
        waiting.append(job)
        waiting.sort(key=lambda j: j.rank)

    def _leave(self, job: _Job) -> None:
        if job.left:
            return
        job.left = True
        self._live.pop(id(job), None)
        waiting = self._waiting.get(job.tenant)
        if waiting is not None and job in waiting:
            waiting.remove(job)
            if not waiting:
                del self._waiting[job.tenant]
        self._active[job.tenant] -= 1
        if self._active[job.tenant] <= 0:
            del self._active[job.tenant]
            self._forget_idle()

    def _forget_idle(self) -> None:
        """Drop the counters an idle tenant would be lifted over anyway (the dict stays as
        small as the set of busy tenants, give or take those ahead of them)."""
        if not self._active:
            self.counters.clear()
            return
        low = min(self.counters.get(t, 0.0) for t in self._active)
        for tenant in [t for t, c in self.counters.items() if t not in self._active and c <= low]:
            del self.counters[tenant]

    async def _run(self) -> None:
        try:
            while self._waiting:
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

    def _next_job(self) -> _Job | None:
        """The least-served tenant's first job with rows to run (ties: the earlier job)."""
        best: _Job | None = None
        for tenant in list(self._waiting):
            jobs = self._waiting[tenant]
            while jobs and (jobs[0].future.done() or jobs[0].exhausted):
                gone = jobs.pop(0)
                if gone.future.done():  # the caller left between two forwards
                    self._leave(gone)
            if not jobs:
                self._waiting.pop(tenant, None)
                continue
            if best is None or (self.counters.get(tenant, 0.0), jobs[0].rank[1]) < (
                    self.counters.get(best.tenant, 0.0), best.rank[1]):
                best = jobs[0]
        return best

    def _take(self) -> list[tuple[_Job, int]]:
        """The next forward's rows, one at a time from the least-served tenant, within both
        budgets; each row is charged to its tenant as it is taken."""
        batch: list[tuple[_Job, int]] = []
        longest = 0
        while len(batch) < self.max_rows:
            job = self._next_job()
            if job is None:
                break
            index = job.order[job.taken]
            size = len(job.rows[index])
            length = max(longest, size)
            if batch and length * (len(batch) + 1) > self.max_tokens:
                break  # the least served goes first in the next forward instead
            longest = length
            batch.append((job, index))
            job.taken += 1
            job.taken_tokens += size
            self.counters[job.tenant] = self.counters.get(job.tenant, 0.0) + size / job.weight
        return batch

    def _scatter(self, batch: list[tuple[_Job, int]], vectors: np.ndarray) -> None:
        for (job, index), vector in zip(batch, vectors, strict=True):
            size = len(job.rows[index])
            self.tokens[job.tenant] += size
            job.done += 1
            job.done_tokens += size
            if job.future.done():  # the caller left: what it took is paid, nothing to keep
                continue
            if job.out is None:
                job.out = np.empty((len(job.rows), vectors.shape[1]), dtype=np.float32)
            job.out[index] = vector
        for job in {id(job): job for job, _ in batch}.values():
            if job.future.done():
                continue
            job.report(job.done_tokens)
            if job.done == len(job.rows):
                assert job.out is not None
                job.future.set_result(job.out)
                self._leave(job)

    def _fail(self, jobs: list[_Job], exc: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)
            self._leave(job)
