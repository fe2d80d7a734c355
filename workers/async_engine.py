"""The engine as the gateway uses it: a background step loop and one async stream per request.

Steps run in a worker thread so the event loop stays free for HTTP. Requests are validated
on the caller's side (errors surface at once) and handed to the step thread through a queue
of operations applied between steps; nothing else crosses threads. Adapter files are read in
the default executor, never on the step thread, so a hot load does not stall running requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from workers.engine.outputs import RequestOutput
from workers.engine.prefix_hash import PrefixSummary
from workers.engine.request import PreparedRequest
from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.llm_engine import LLMEngine
from workers.lora.manager import AdapterBusyError, AdapterStatus

logger = logging.getLogger(__name__)
T = TypeVar("T")
# How stale /stats' view of the adapters may get while steps run (an adapter call refreshes
# it at once); gateways poll every second.
LORAS_SEEN_EVERY_S = 0.1


class EngineDeadError(RuntimeError):
    """The step loop failed; every open stream gets this error."""


@dataclass(frozen=True)
class _Refused:
    """A queued request the engine would not take; the caller's stream raises `error`."""

    request_id: str
    error: Exception


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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading: set[str] = set()  # adapters being read back for parked requests
        self._background: set[asyncio.Task[None]] = set()
        self._loras_seen: list[AdapterStatus] = []  # as of a recent step or the last call
        self._loras_seen_at = 0.0

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
        self.engine.read_adapters_in_step = False
        self.engine.arrivals = self
        self._loras_seen = self.engine.list_loras()  # the step loop has not started yet
        self._loop = asyncio.get_running_loop()
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

    def prefix_summary(self) -> PrefixSummary | None:
        return self._require_engine().prefix_summary()

    def tenant_tokens(self) -> dict[str, int]:
        """Tokens computed per tenant, "" for requests that named none (a copy, safe to take
        beside the step thread; empty before start)."""
        if self.engine is None:
            return {}
        return {tenant or "": n for tenant, n in self.engine.tenant_tokens().items()}

    async def generate(
        self,
        prompt: str | list[int] | PreparedRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: str | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
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
                                              cache_salt=cache_salt, lora=lora)
            prepared = dataclasses.replace(prepared, tenant=tenant, weight=weight)
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

    def stop_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """End one sample between steps (see LLMEngine.stop_sample), like an abort."""
        self._push(("stop", (request_id, index, stop_reason)))

    async def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._push(("abort", request_id))

    # ---- adapters -------------------------------------------------------------------------

    async def add_lora(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Read and validate the adapter off the step loop, then register it between steps.

        Idempotent: the same name and path again is a no-op (and reloads it if evicted)."""
        engine = self._require_engine()
        adapter = await asyncio.get_running_loop().run_in_executor(
            None, engine.runner.read_adapter, name, path)
        await self._call(lambda e: e.add_lora(name, path, adapter=adapter, pinned=pinned))

    async def remove_lora(self, name: str, *, wait_s: float = 0.0) -> None:
        """Unload. New requests for it are refused at once; in-flight ones get up to `wait_s`
        to finish, after which the adapter stays and AdapterBusyError says why."""
        deadline = time.monotonic() + wait_s
        while not await self._call(lambda e: e.remove_lora(name, drain=wait_s > 0)):
            if time.monotonic() >= deadline:
                await self._call(lambda e: e.cancel_unload(name))
                raise AdapterBusyError(f"adapter {name!r} still has requests in flight after "
                                       f"{wait_s:g}s; it stays loaded")
            await asyncio.sleep(0.02)

    async def list_loras(self) -> list[AdapterStatus]:
        return await self._call(lambda e: e.list_loras())

    def loras_seen(self) -> list[AdapterStatus]:
        """The adapters as of a step at most `LORAS_SEEN_EVERY_S` old, or the last adapter
        call, without waiting for the step in flight: /stats must answer within its poll
        timeout while a long prefill runs."""
        return self._loras_seen

    async def _call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the step thread between steps (engine state is not shared)."""
        if self._dead is not None:
            raise EngineDeadError("engine step loop has failed") from self._dead
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._push(("call", (fn, future)))
        return await future

    def _push(self, op: tuple[str, Any]) -> None:
        with self._ops_lock:
            self._ops.append(op)
        self._wakeup.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self._require_engine()
        try:
            while True:
                if not self._ops and not engine.has_schedulable_work():
                    await self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                self._deliver(await loop.run_in_executor(self._executor, self._step))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the step failed: fail every stream, loudly
            logger.exception("engine step loop died")
            self._dead = exc
            for queue in self._streams.values():
                queue.put_nowait(EngineDeadError(f"engine failed: {exc!r}"))
            for kind, payload in self._ops:
                if kind == "call" and not payload[1].done():
                    payload[1].set_exception(EngineDeadError(f"engine failed: {exc!r}"))
            raise

    def _deliver(self, outputs: Iterable[RequestOutput | _Refused]) -> None:
        """On the event loop: each output to its request's stream."""
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output.error if isinstance(output, _Refused) else output)

    # ---- requests that arrive while a step runs (engine.interjection.Arrivals) -------------

    def admit(self, engine: LLMEngine) -> None:
        """In the step thread, between two layers: enqueue the adds at the head of the queue
        (up to the first other operation, which waits for the step's end with what follows
        it, so operations still apply in order)."""
        if not self._ops or self._ops[0][0] != "add":  # the common case, without the lock
            return
        with self._ops_lock:
            adds = []
            while self._ops and self._ops[0][0] == "add":
                adds.append(self._ops.popleft()[1])
        refused: list[RequestOutput | _Refused] = []
        for request_id, prepared, priority in adds:
            try:
                self._add(engine, request_id, prepared, priority)
            except InvalidRequestError as exc:
                refused.append(_Refused(request_id, exc))
        if refused:
            self.publish(refused)

    def publish(self, outputs: Iterable[RequestOutput | _Refused]) -> None:
        """From the step thread: deliver on the event loop now, not when the step ends."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _step(self) -> list[RequestOutput | _Refused]:
        """In the step thread: apply queued adds and aborts, then one engine step."""
        engine = self._require_engine()
        with self._ops_lock:
            ops, self._ops = list(self._ops), collections.deque()
        refused: list[RequestOutput | _Refused] = []
        for kind, payload in ops:
            if kind == "add":
                request_id, prepared, priority = payload
                try:
                    self._add(engine, request_id, prepared, priority)
                except InvalidRequestError as exc:  # e.g. its adapter was just unloaded
                    refused.append(_Refused(request_id, exc))
            elif kind == "call":
                self._apply_call(*payload)
            elif kind == "stop":
                engine.stop_sample(*payload)
            else:
                engine.abort_request(payload)
        self._start_adapter_reads(engine)
        if not engine.has_schedulable_work():
            return refused
        outputs = engine.step()
        now = time.monotonic()
        if now - self._loras_seen_at >= LORAS_SEEN_EVERY_S:  # not a list per step
            self._loras_seen, self._loras_seen_at = engine.list_loras(), now
        return refused + outputs

    def _apply_call(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future[Any]) -> None:
        assert self._loop is not None
        engine = self._require_engine()
        try:
            result = fn(engine)
        except Exception as exc:  # handed to the awaiting caller, not swallowed
            self._loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            self._loras_seen = engine.list_loras()  # before the caller sees its call done
            self._loop.call_soon_threadsafe(_settle, future, result, None)

    def _start_adapter_reads(self, engine: LLMEngine) -> None:
        assert self._loop is not None
        for name, path in engine.pending_lora_reads():
            if name not in self._reading:
                self._reading.add(name)
                self._loop.call_soon_threadsafe(self._read_back, name, path)

    def _read_back(self, name: str, path: str) -> None:
        """On the event loop: read an evicted adapter for its parked requests."""
        async def read() -> None:
            engine = self._require_engine()
            try:
                adapter = await asyncio.get_running_loop().run_in_executor(
                    None, engine.runner.read_adapter, name, path)
            except (OSError, ValueError) as exc:
                logger.error("adapter %s could not be read back from %s: %s", name, path, exc)
                failed = await self._call(lambda e: e.fail_lora(name))
                for request_id in failed:
                    queue = self._streams.get(request_id)
                    if queue is not None:
                        queue.put_nowait(exc)
            else:
                await self._call(lambda e: e.put_lora(name, adapter))
            finally:
                self._reading.discard(name)

        task = asyncio.create_task(read(), name=f"read-adapter-{name}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
