"""The engine as the gateway uses it: a background step loop and one async stream per request.

Steps run in a worker thread so the event loop stays free for HTTP. Requests are validated
on the caller's side (errors surface at once) and handed to the step thread through a queue
of operations applied between steps; nothing else crosses threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.llm_engine import LLMEngine, PreparedRequest

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop failed; every open stream gets this error."""


class AsyncLLMEngine:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._engine_args = {"model": model, **engine_args}
        self.engine: LLMEngine | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._ops: collections.deque[tuple[str, Any]] = collections.deque()
        self._ops_lock = threading.Lock()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._loop_task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._dead: BaseException | None = None

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> AsyncLLMEngine:
        """Wrap an already loaded engine (tests, or a process that loaded it itself)."""
        self = cls()
        self.engine = engine
        return self

    async def start(self) -> None:
        """Load the model (off the event loop) and start the step loop."""
        if self.engine is None:
            self.engine = await asyncio.get_running_loop().run_in_executor(
                self._executor, lambda: LLMEngine.from_args(**self._engine_args)
            )
        self._loop_task = asyncio.create_task(self._run(), name="engine-step-loop")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._executor.shutdown(wait=True)

    @property
    def tokenizer(self) -> Any:
        return self._require_engine().tokenizer

    def stats(self) -> dict[str, float]:
        return self._require_engine().stats()

    async def generate(
        self,
        prompt: str | list[int] | PreparedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs as tokens arrive; leaving early aborts the request.

        A `PreparedRequest` (from `engine.prepare_request`) is queued as it is: callers that
        validated already do not pay for tokenizing and checking twice."""
        engine = self._require_engine()
        if self._dead is not None:
            raise EngineDeadError("engine step loop has failed") from self._dead
        request_id = request_id or f"req-{next(self._ids)}"
        engine.check_capacity(len(self._ops))
        if isinstance(prompt, PreparedRequest):
            prepared = prompt
        else:
            prepared = engine.prepare_request(prompt, sampling_params or SamplingParams(),
                                              cache_salt=cache_salt)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._streams[request_id] = queue
        self._push(("add", (request_id, prepared, priority)))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._push(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._push(("abort", request_id))

    def _push(self, op: tuple[str, Any]) -> None:
        with self._ops_lock:
            self._ops.append(op)
        self._wakeup.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self._require_engine()
        try:
            while True:
                if not self._ops and not engine.has_unfinished_requests():
                    await self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                outputs = await loop.run_in_executor(self._executor, self._step)
                for output in outputs:
                    queue = self._streams.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the step failed: fail every stream, loudly
            logger.exception("engine step loop died")
            self._dead = exc
            for queue in self._streams.values():
                queue.put_nowait(EngineDeadError(f"engine failed: {exc!r}"))
            raise

    def _step(self) -> list[RequestOutput]:
        """In the step thread: apply queued adds and aborts, then one engine step."""
        engine = self._require_engine()
        with self._ops_lock:
            ops, self._ops = list(self._ops), collections.deque()
        for kind, payload in ops:
            if kind == "add":
                request_id, prepared, priority = payload
                self._add(engine, request_id, prepared, priority)
            else:
                engine.abort_request(payload)
        if not engine.has_unfinished_requests():
            return []
        return engine.step()

    def _add(
        self, engine: LLMEngine, request_id: str, prepared: PreparedRequest, priority: int
    ) -> None:
        if request_id not in self._streams:
            return  # the caller left before its request reached the engine
        engine.enqueue(request_id, prepared, priority=priority)

    def _require_engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been awaited")
        return self.engine
