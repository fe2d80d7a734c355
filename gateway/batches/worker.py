"""The batch worker: runs tenants' batches in the gateway process, in the background.

Ownership. The app's lifespan starts one worker (unless `batch_worker` is off) after the
gateway state is open and stops it before the state closes. Each batch it runs is leased in
the database (`tenancy.batches.claim`): renewed every checkpoint, given back on a clean stop,
left to lapse (`batch_lease_s`) when a process dies. A process finds open batches whose lease
is free every `batch_poll_interval_s` (at once for a batch created or cancelled through it).

A batch's life here:

    validating   the input file scanned (`gateway.batches.lines`): a line that cannot be
                 reported under a custom_id fails the batch (status failed, `errors`); a
                 line refused like a live request is written to the error file at once
    in_progress  lines answered through the request path without a client, at most
                 `batch_max_concurrency` at once over every batch of the process (fewer
                 while live requests are in flight), chosen fairly between tenants (the
                 tenant with the fewest lines in flight, then the least served by plan
                 weight); each at priority 10, the engine's background class (run only in
                 what live requests of every tenant leave), and the plan's batch price
    finalizing   the partial output and error files become the tenant's files
    completed    ... or cancelled (a cancel stops new lines; those in flight finish), or
                 expired (the window passed: the lines not answered go to the error file as
                 `batch_expired`)

Durability. Each answered line is written to the batch's partial files before it counts,
and a restart resumes from the lines not yet written (`gateway.batches.run`).

Limits. A line is admitted as a live request of the key that created the batch: its RPM,
TPM, concurrency and the tenant's budget apply. A line refused 429 (or 503: nothing could
serve it now) is not failed: it goes back to the front of its batch, which waits for the
retry-after before its next line, until the window expires. A tenant's batch lines in flight
are also held to half its plan's (or key's) concurrency limit, so its own live requests find
room.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError
from starlette.responses import Response

from gateway.batches import lines
from gateway.batches.endpoints import ENDPOINTS
from gateway.batches.files import FileStore
from gateway.batches.objects import Progress
from gateway.batches.run import Pending, Run, record, usage_of
from gateway.errors import APIError, error_body
from gateway.observability.logs import bind_tenant, request_log
from gateway.request_path import Origin
from gateway.state import GatewayState
from tenancy import batches as rows
from tenancy.batches import OPEN_STATUSES, Batch, StoredFile, new_file_id
from tenancy.models import utcnow
from workers.engine.sequence import BACKGROUND_PRIORITY

logger = logging.getLogger(__name__)

# The engine's background class (the lowest of -10..10): batch lines run only in what live
# traffic leaves, of every tenant, not just last within their own (workers/engine/scheduler).
BATCH_PRIORITY = BACKGROUND_PRIORITY
CHECKPOINT_S = 1.0  # counts written, lease renewed, cancel and expiry looked for
LOAD_POLL_S = 0.05  # how often a held-back dispatcher looks at live traffic again
STOP_GRACE_S = 10.0  # stop() waits this long for cancelled work, then for the leases' write
EXPIRED = {"code": "batch_expired",
           "message": "This request could not be executed before the completion window "
                      "expired."}


@dataclass(frozen=True)
class Retry:
    after_s: float


class BatchWorker:
    def __init__(self, gw: GatewayState, store: FileStore) -> None:
        self.gw = gw
        self.store = store
        self.settings = gw.settings
        self.owner = uuid.uuid4().hex  # this process, in batches' leases
        self.runs: dict[str, Run] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # one per run
        self._lines: set[asyncio.Task[None]] = set()  # one per line in flight
        self._in_flight = 0
        self._tenant_in_flight: dict[str, int] = {}
        self._served: dict[str, float] = {}  # lines started per tenant, over its weight
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loops = [asyncio.create_task(self._poll(), name="batch-poll"),
                       asyncio.create_task(self._dispatch(), name="batch-dispatch")]

    async def stop(self) -> None:
        """Stop everything: lines in flight are cancelled (their work billed, and answered
        again on resume), leases given back so a restart resumes at once."""
        for task in self._loops:
            task.cancel()
        for task in (*self._lines, *self._tasks):
            task.cancel()
        left = list(self.runs.values())  # the runs' tasks forget them as they end
        tasks = {*self._loops, *self._lines, *self._tasks}
        if tasks:  # bounded: a shutdown never hangs on one stuck line or a locked database
            _, stuck = await asyncio.wait(tasks, timeout=STOP_GRACE_S)
            if stuck:
                logger.error("batch worker stopped with %d task(s) still running: %s",
                             len(stuck), ", ".join(sorted(t.get_name() for t in stuck)))
        try:
            async with asyncio.timeout(STOP_GRACE_S), self.gw.sessionmaker() as session:
                for run in left:  # the counts as far as the partial files go
                    await session.execute(
                        update(Batch).where(Batch.id == run.id, Batch.lease_owner == self.owner)
                        .values(**self._counts(run))
                        .execution_options(synchronize_session=False))
                await rows.release(session, owner=self.owner)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            logger.warning("batch leases not given back (%s); they lapse in %g s",
                           type(exc).__name__, self.settings.batch_lease_s)

    def wake(self) -> None:
        """A batch was created (or cancelled) through this process: look now."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """The batch was set cancelling: if it runs here, no new line starts."""
        run = self.runs.get(batch_id)
        if run is not None:
            run.stop("cancelled")
        else:
            self.wake()

    def progress(self, batch_id: str) -> Progress | None:
        run = self.runs.get(batch_id)
        return None if run is None else run.progress()

    # --- finding batches ------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            try:
                await self._claim_open()
            except (SQLAlchemyError, OSError) as exc:
                logger.warning("looking for batches failed: %s", type(exc).__name__)
            await wait_for_event(self._wake, self.settings.batch_poll_interval_s)
            self._wake.clear()

    async def _claim_open(self) -> None:
        now = utcnow()
        async with self.gw.sessionmaker() as session:
            ids = await rows.claimable(session, owner=self.owner, now=now)
        for batch_id in ids:
            if batch_id in self.runs:
                continue
            async with self.gw.sessionmaker() as session:
                claimed = await rows.claim(session, batch_id=batch_id, owner=self.owner,
                                           now=now, until=self._lease_until())
            if claimed:
                task = asyncio.create_task(self._run(batch_id), name=f"batch-{batch_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _lease_until(self) -> datetime:
        return utcnow() + timedelta(seconds=self.settings.batch_lease_s)

    # --- one batch ------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        async with self.gw.sessionmaker() as session:
            row = await session.get(Batch, batch_id)
        if row is None or row.status not in OPEN_STATUSES:
            return
        endpoint = ENDPOINTS.get(row.endpoint)
        run = Run(row.id, row.tenant_id, row.key_id, row.created_at, row.expires_at,
                  endpoint or next(iter(ENDPOINTS.values())),
                  self.store.path(row.tenant_id, row.input_file_id),
                  self.store.work_dir(row.tenant_id, row.id), row.status)
        self.runs[batch_id] = run
        try:
            if endpoint is None:  # a batch of an endpoint this gateway no longer serves
                await self._fail(run, [{"code": "invalid_endpoint", "param": "endpoint",
                                        "line": None, "message": f"This gateway does not "
                                        f"serve '{row.endpoint}' in batches."}])
                return
            if row.status == "cancelling" and row.in_progress_at is None:
                await self._finish(run, "cancelled")  # cancelled before it started
                return
            problems = await asyncio.to_thread(self._prepare, run)
            if problems:
                await self._fail(run, problems)
                return
            await self._started(run)
            await self._limits_of(run)
            if row.status == "cancelling":  # cancelled while another process ran it
                run.stop("cancelled")
            elif utcnow() >= run.expires_at:
                run.stop("expired")
            self._activate(run)
            last = time.monotonic()
            while not run.done:
                await wait_for_event(run.changed, CHECKPOINT_S)
                run.changed.clear()
                if time.monotonic() - last >= CHECKPOINT_S:
                    await self._checkpoint(run)
                    last = time.monotonic()
            await self._checkpoint(run)  # a cancel or the window may have come in meanwhile
            if run.stopping == "lost":
                return
            await self._finish(run, run.stopping or "completed")
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug or a broken file: the batch fails rather than being retried forever.
            logger.exception("batch %s could not be run", batch_id)
            with contextlib.suppress(Exception):
                await self._fail(run, [{"code": "server_error", "param": None, "line": None,
                                        "message": "The server had an error processing this "
                                                   "batch."}])
        finally:
            run.dispatching = False
            run.close()
            self.runs.pop(batch_id, None)

    def _prepare(self, run: Run) -> list[dict[str, Any]]:
        """Scan the input, recover what an earlier run wrote, write the refused lines not
        yet written, and queue the rest. Blocking (a thread). The problems that fail it."""
        run.work.mkdir(parents=True, exist_ok=True)
        done: set[str] = set()
        for entry in run.output.recover():
            done.add(entry["custom_id"])
            run.completed += 1
            prompt, cached, output = usage_of(entry)
            run.input_tokens += prompt
            run.cached_tokens += cached
            run.output_tokens += output
        for entry in run.errors.recover():
            done.add(entry["custom_id"])
            run.failed += 1
        scan = lines.scan(run.input_path, run.endpoint, max_lines=self.settings.batch_max_lines,
                          max_body_bytes=self.settings.max_body_bytes)
        if scan.problems:
            return scan.problems
        run.total, run.model = scan.total, scan.model
        run.output.open()
        run.errors.open()
        for entry in scan.entries:
            if entry.custom_id in done:
                continue
            if entry.invalid is not None:
                request_id = f"batch_req_{uuid.uuid4().hex}"
                run.answered(record(entry.custom_id, request_id, entry.invalid.status,
                                    entry.invalid.error), ok=False)
            else:
                run.pending.append(Pending(entry.number, entry.offset, entry.length,
                                           entry.custom_id))
        return []

    async def _started(self, run: Run) -> None:
        """validating -> in_progress (unless it was cancelled meanwhile)."""
        now = utcnow()
        async with self.gw.sessionmaker() as session:
            await session.execute(
                update(Batch).where(Batch.id == run.id, Batch.status == "validating")
                .values(status="in_progress", in_progress_at=now)
                .execution_options(synchronize_session=False))
            await session.execute(
                update(Batch).where(Batch.id == run.id)
                .values(total=run.total, model=run.model, **self._counts(run))
                .execution_options(synchronize_session=False))
            await session.commit()

    async def _limits_of(self, run: Run) -> None:
        """The plan's weight, and the most lines in flight: half the tighter of the key's
        and the plan's concurrency limits (at least one)."""
        try:
            key = await self.gw.keys.tenant_by_id(run.key_id)
        except APIError:
            return  # each line will say why
        run.weight = key.plan.engine_weight
        limits = [n for n in (key.max_concurrent, key.plan.max_concurrent) if n is not None]
        run.cap = max(1, min(limits) // 2) if limits else None

    async def _checkpoint(self, run: Run) -> None:
        """Counts written and the lease renewed; a cancel, the window's end, or a lease lost
        to another process noticed."""
        try:
            async with self.gw.sessionmaker() as session:
                result = await session.execute(
                    update(Batch).where(Batch.id == run.id, Batch.lease_owner == self.owner)
                    .values(lease_until=self._lease_until(), **self._counts(run))
                    .execution_options(synchronize_session=False))
                found = (await session.execute(select(Batch.status, Batch.expires_at)
                                               .where(Batch.id == run.id))).first()
                await session.commit()
        except (SQLAlchemyError, OSError) as exc:
            logger.warning("batch %s checkpoint failed: %s", run.id, type(exc).__name__)
            return
        if not getattr(result, "rowcount", 0) or found is None:
            run.stop("lost")
            return
        status, run.expires_at = found
        if status == "cancelling":
            run.stop("cancelled")
        elif utcnow() >= run.expires_at:
            run.stop("expired")

    @staticmethod
    def _counts(run: Run) -> dict[str, int]:
        return {"completed": run.completed, "failed": run.failed,
                "input_tokens": run.input_tokens, "cached_tokens": run.cached_tokens,
                "output_tokens": run.output_tokens}

    async def _fail(self, run: Run, problems: list[dict[str, Any]]) -> None:
        now = utcnow()
        async with self.gw.sessionmaker() as session:
            await session.execute(
                update(Batch).where(Batch.id == run.id)
                .values(status="failed", failed_at=now, errors=problems, lease_owner=None,
                        lease_until=None)
                .execution_options(synchronize_session=False))
            await session.commit()
        run.close()
        await asyncio.to_thread(self.store.remove_work, run.tenant_id, run.id)
        logger.info("batch %s failed validation (%s)", run.id, problems[0]["code"])

    async def _finish(self, run: Run, status: str) -> None:
        """The partial files become the tenant's output and error files, and the batch
        takes its final status, in one transaction."""
        if status == "expired" and run.pending:
            if run.errors._file is None:
                run.errors.open()
            while run.pending:
                line = run.pending.popleft()
                run.answered(record(line.custom_id, f"batch_req_{uuid.uuid4().hex}", None, None,
                                    EXPIRED), ok=False)
        now = utcnow()
        if status == "completed":
            async with self.gw.sessionmaker() as session:
                await session.execute(
                    update(Batch).where(Batch.id == run.id)
                    .values(status="finalizing", finalizing_at=now, **self._counts(run))
                    .execution_options(synchronize_session=False))
                await session.commit()
        run.close()
        files: list[StoredFile] = []
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for column, partial, suffix in (("output_file_id", run.output, "output"),
                                        ("error_file_id", run.errors, "error")):
            if partial.lines and partial.path.exists():
                file_id = new_file_id()
                size = await asyncio.to_thread(self.store.adopt, run.tenant_id, file_id,
                                               partial.path)
                files.append(StoredFile(id=file_id, tenant_id=run.tenant_id,
                                        filename=f"{run.id}_{suffix}.jsonl",
                                        purpose="batch_output", bytes=size))
                ids[column] = file_id
        async with self.gw.sessionmaker() as session:
            session.add_all(files)
            await session.execute(
                update(Batch).where(Batch.id == run.id)
                .values(status=status, **{f"{status}_at": utcnow()}, **ids,
                        **self._counts(run), lease_owner=None, lease_until=None)
                .execution_options(synchronize_session=False))
            await session.commit()
        await asyncio.to_thread(self.store.remove_work, run.tenant_id, run.id)
        logger.info("batch %s %s: %d completed, %d failed of %d", run.id, status,
                    run.completed, run.failed, run.total)

    # --- lines ----------------------------------------------------------------------------

    def _activate(self, run: Run) -> None:
        """The run's lines may be dispatched. A tenant coming back from idle starts level
        with the least served tenant with work, not ahead by the service it did not use."""
        busy = [self._served.get(r.tenant_id, 0.0) for r in self.runs.values()
                if r.dispatching and r.tenant_id != run.tenant_id]
        if busy and not any(r.dispatching for r in self.runs.values()
                            if r.tenant_id == run.tenant_id):
            self._served[run.tenant_id] = max(self._served.get(run.tenant_id, 0.0), min(busy))
        run.dispatching = True
        self._changed.set()

    def _limit(self) -> int:
        """Lines in flight allowed now: fewer while live requests are in flight here (calls
        on any deployment that are not this worker's lines)."""
        registry = self.gw.deployments
        upstream = sum(registry.health(d.name).in_flight for d in registry.deployments())
        if upstream > self._in_flight:
            return self.settings.batch_concurrency_under_load
        return self.settings.batch_max_concurrency

    def _pick(self, now: float) -> Run | None:
        ready: dict[str, list[Run]] = {}
        for run in self.runs.values():
            if (run.dispatching and run.pending and run.stopping is None
                    and run.not_before <= now
                    and (run.cap is None
                         or self._tenant_in_flight.get(run.tenant_id, 0) < run.cap)):
                ready.setdefault(run.tenant_id, []).append(run)
        if not ready:
            return None
        tenant = min(ready, key=lambda t: (self._tenant_in_flight.get(t, 0),
                                           self._served.get(t, 0.0), t))
        return min(ready[tenant], key=lambda r: (r.created_at, r.id))

    def _next_wait(self, now: float) -> float:
        waits = [r.not_before - now for r in self.runs.values()
                 if r.dispatching and r.pending and r.stopping is None and r.not_before > now]
        return max(0.001, min([1.0, *waits]))

    async def _dispatch(self) -> None:
        while True:
            now = time.monotonic()
            self._changed.clear()  # before looking: a change from here on wakes the wait
            run = self._pick(now)
            if run is None or self._in_flight >= self._limit():
                wait = LOAD_POLL_S if run is not None else self._next_wait(now)
                await wait_for_event(self._changed, wait)
                continue
            line = run.pending.popleft()
            run.in_flight += 1
            self._in_flight += 1
            tenant = run.tenant_id
            self._tenant_in_flight[tenant] = self._tenant_in_flight.get(tenant, 0) + 1
            self._served[tenant] = self._served.get(tenant, 0.0) + 1.0 / max(run.weight, 1e-6)
            task = asyncio.create_task(self._line(run, line), name=f"batch-line-{run.id}")
            self._lines.add(task)
            task.add_done_callback(self._lines.discard)

    async def _line(self, run: Run, line: Pending) -> None:
        try:
            outcome = await self._answer(run, line)
            if isinstance(outcome, Retry):
                run.pending.appendleft(line)
                run.not_before = max(run.not_before, time.monotonic() + outcome.after_s)
            else:
                entry, ok = outcome
                run.answered(entry, ok=ok)
        finally:
            run.in_flight -= 1
            self._in_flight -= 1
            self._tenant_in_flight[run.tenant_id] -= 1
            if not self._tenant_in_flight[run.tenant_id]:
                del self._tenant_in_flight[run.tenant_id]
            run.changed.set()
            self._changed.set()

    async def _answer(self, run: Run, line: Pending) -> Retry | tuple[dict[str, Any], bool]:
        """One line through the request path, as a live request of the batch's key."""
        request_id = f"batch_req_{uuid.uuid4().hex}"  # also its usage record's id

        def failed(status: int, body: Any) -> tuple[dict[str, Any], bool]:
            return record(line.custom_id, request_id, status, body), False

        checked = lines.check_line(run.read(line), run.endpoint,
                                   max_body_bytes=self.settings.max_body_bytes)
        if isinstance(checked, lines.Invalid):
            return failed(checked.status, checked.error)
        if isinstance(checked, lines.Broken):  # the file changed under the batch
            return failed(400, error_body(checked.message, "invalid_request_error",
                                          checked.code, checked.param))
        try:
            key = await self.gw.keys.tenant_by_id(run.key_id)
        except APIError as exc:
            return failed(exc.status, exc.body())
        origin = Origin(headers={}, receive=None,
                        state={"request_id": request_id, "upstream_s": 0.0},
                        priority=BATCH_PRIORITY, price_percent=key.plan.batch_price_percent,
                        batch_id=run.id)
        with request_log(request_id):
            bind_tenant(key.tenant_id)
            try:
                body = checked.body
                if run.endpoint.read is not None:
                    body = await run.endpoint.read(self.gw, key, checked.raw_body)
                response = await run.endpoint.answer(self.gw, key, body, origin)
            except APIError as exc:
                wait = self._retry_after(exc)
                if wait is not None:
                    return Retry(wait)
                return failed(exc.status, exc.body())
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch %s line %d failed", run.id, line.number)
                return failed(500, error_body("The server had an error processing your "
                                              "request.", "server_error"))
        return self._answered(line.custom_id, request_id, response)

    @staticmethod
    def _answered(custom_id: str, request_id: str, response: Response
                  ) -> tuple[dict[str, Any], bool]:
        body_bytes = getattr(response, "body", None)
        if not isinstance(body_bytes, bytes | memoryview):  # a stream: refused when checked
            return record(custom_id, request_id, 500, error_body(
                "The answer could not be kept.", "server_error")), False
        try:
            body = json.loads(bytes(body_bytes))
        except ValueError:
            body = None
        status = response.status_code
        return record(custom_id, request_id, status, body), 200 <= status < 300

    def _retry_after(self, exc: APIError) -> float | None:
        """How long a refused line waits before it is tried again; None: it failed."""
        if exc.status == 429:
            try:
                return max(0.05, float(exc.headers.get("retry-after", "")))
            except ValueError:
                return self.settings.batch_retry_s
        if exc.status == 503:
            return self.settings.batch_retry_s
        return None


async def wait_for_event(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set or `timeout_s` has passed. Not `asyncio.wait_for`: on Python 3.11
    it drops a cancel that comes as the event is set, and a loop around it never stops."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
