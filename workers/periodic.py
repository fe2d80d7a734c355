"""One background loop shape for every "refresh every N seconds" task in the system.

Auth-version polls, budget reconciliation, worker heartbeats, worker discovery and each
gateway's poll of a worker's load all run a step on an interval, survive the expected errors
of that step (a database or Redis that does not answer this round) and stop on cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

STOP_RETRY_S = 1.0  # how long stop() waits on a cancelled loop before cancelling it again
STOP_TRIES = 10  # then shutdown goes on without it


class Periodic:
    """Awaits `step()` every `interval_s` after `start()` until `stop()`.

    Errors of the types in `survive` are logged (by type only: messages may name hosts or
    credentials) and the loop goes on; anything else ends the task, so a bug is not hidden.

    `stop()` also works when a step swallows the cancellation (a client library's timeout
    that fires in the same instant may turn it into its own TimeoutError, which the step
    survives): the loop checks a stop flag after every step, and `stop()` cancels again
    until the task ends (`STOP_TRIES` times at most), so shutdown never waits forever."""

    def __init__(self, step: Callable[[], Awaitable[object]], *, interval_s: float, name: str,
                 survive: tuple[type[BaseException], ...] = ()) -> None:
        self.interval_s = interval_s
        self.name = name
        self._step = step
        self._survive = survive
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if task.done():  # it died of an unexpected error: say so, but let shutdown go on
            if not task.cancelled() and task.exception() is not None:
                logger.error("%s had stopped on an error", self.name,
                             exc_info=task.exception())
            return
        self._stopping = True
        for _ in range(STOP_TRIES):
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=STOP_RETRY_S)
            if done:
                break
            logger.warning("%s did not stop on cancel; cancelling again", self.name)
        else:
            logger.error("%s ignored %d cancels; left behind", self.name, STOP_TRIES)
            return
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval_s)
            try:
                await self._step()
            except self._survive as exc:
                logger.warning("%s failed (%s); retrying in %gs", self.name,
                               type(exc).__name__, self.interval_s)
