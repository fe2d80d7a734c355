"""Try a plan's deployments in order until one answers, before the client sees a byte.

A deployment is tried when its breaker lets a request through. Connection errors, timeouts,
5xx and upstream 429s count against it and move on; a prompt too long for its context moves
on to a deployment with a larger window; any other client error is the client's and is
raised at once. A stream counts as answered once its first event is in hand: that event is
what the client sees first, so nothing is ever retried after a byte has gone out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway.deployments.base import Call, Deployment, UpstreamFailure, prepared
from gateway.deployments.registry import DeploymentRegistry
from gateway.errors import APIError
from gateway.routing.health import DeploymentHealth
from workers.protocol.events import Event, Failed, aclose
from workers.protocol.render import Fold, fold
from workers.protocol.usage import GRAMMAR_ERROR

if TYPE_CHECKING:
    from gateway.observability.metrics import GatewayMetrics

CONTEXT_CODE = "context_length_exceeded"


@dataclass
class Served:
    """The deployment that answered, its call, and the answer: folded whole, or a stream
    whose first event has already arrived."""

    deployment: Deployment
    call: Call
    result: Fold | Started | Any  # what `serve`'s `run` gave (embeddings: bytes)
    attempts: int
    release: Callable[[], None] = field(repr=False, default=lambda: None)


class AllAttemptsFailed(Exception):
    def __init__(self, last: UpstreamFailure, attempts: int) -> None:
        super().__init__(last.message)
        self.last = last
        self.attempts = attempts

    def as_error(self, headers: dict[str, str]) -> APIError:
        """The client's error: the last failure's status and words, with `headers`."""
        failure = self.last
        extra = {"retry-after": failure.retry_after} if failure.retry_after else {}
        return APIError(failure.status, failure.message, type_="server_error",
                        code=failure.code, headers={**headers, **extra,
                                                    "x-switchboard-attempts": str(self.attempts)})


@dataclass
class Fallbacks:
    registry: DeploymentRegistry
    max_attempts: int = 3
    budget_s: float = 60.0  # the whole search, from the first attempt to the first byte
    metrics: GatewayMetrics | None = None

    async def serve(self, order: list[Deployment], first_call: Call, *, stream: bool,
                    request_id: str, prepare: Callable[[Deployment], Call],
                    on_call: Callable[[Call], None] | None = None,
                    run: Attempt | None = None) -> Served:
        """`prepare` makes the call for a later deployment (each counts its own tokens);
        `run` makes one attempt (default: open the answer, see `answer`)."""
        run = run or answer
        deadline = time.monotonic() + self.budget_s
        attempts = 0
        last: UpstreamFailure | None = None
        too_long = TooLong()
        for index, deployment in enumerate(order):
            if attempts >= self.max_attempts or time.monotonic() >= deadline:
                break
            if too_long.skips(deployment):
                continue
            health = self.registry.health(deployment.name)
            if not health.breaker.try_acquire():
                continue
            try:
                call = first_call if index == 0 else await prepared(deployment, prepare)
            except APIError as exc:
                health.breaker.release()
                too_long.refused(deployment, exc)
                continue
            if on_call is not None:
                on_call(call)
            attempts += 1
            tag = request_id if attempts == 1 else f"{request_id}-{attempts}"
            health.in_flight += 1
            started = time.monotonic()
            try:
                # The budget covers the search up to the first byte: the answer's first event
                # (the deployment is generating) lifts the deadline, so a request making
                # progress is never cut by it, streamed or not.
                async with asyncio.timeout(max(0.001, deadline - started)) as window:
                    result = await run(deployment, call, stream=stream, request_id=tag,
                                       answering=lambda w=window: w.reschedule(None))
            except UpstreamFailure as exc:
                health.in_flight -= 1
                health.failed()
                self._observe(deployment, exc.code)
                last = exc
                continue
            except TimeoutError:
                health.in_flight -= 1
                health.failed()
                last = UpstreamFailure(504, "the upstream timed out", code="upstream_timeout")
                self._observe(deployment, last.code)
                continue
            except APIError as exc:
                health.in_flight -= 1
                health.breaker.release()
                self._observe(deployment, exc.code or "client_error")
                too_long.refused(deployment, exc)
                continue
            except BaseException:  # cancelled (the client left) or a bug: no verdict
                health.in_flight -= 1
                health.breaker.release()
                self._observe(deployment, None)
                raise
            health.succeeded(time.monotonic() - started)
            self._observe(deployment, None)
            return Served(deployment, call, result, attempts, release=_once(health))
        if last is None and too_long.first is not None:
            raise too_long.first
        raise AllAttemptsFailed(last or UpstreamFailure(
            503, "no deployment could take the request; retry later",
            code="no_healthy_deployment"), attempts)

    def _observe(self, deployment: Deployment, error_code: str | None) -> None:
        if self.metrics is not None:
            self.metrics.attempt(deployment.name, error_code)


@dataclass
class TooLong:
    """Deployments whose context window a prompt overflowed: any no larger is skipped, and
    the first refusal is what the client gets if no window holds it. Any other client error
    goes to the client at once."""

    first: APIError | None = None
    window: int = 0  # the largest window refused so far

    def skips(self, deployment: Deployment) -> bool:
        return deployment.config.context_window <= self.window

    def refused(self, deployment: Deployment, exc: APIError) -> None:
        if exc.code != CONTEXT_CODE:
            raise exc
        self.first = self.first or exc
        self.window = max(self.window, deployment.config.context_window)


class Attempt(Protocol):
    async def __call__(self, deployment: Deployment, call: Call, *, stream: bool,
                       request_id: str, answering: Callable[[], None]) -> Any: ...


@dataclass
class Started:
    """A streamed answer whose first event is in hand, and the rest of its events."""

    first: Event
    rest: AsyncIterator[Event]


async def answer(deployment: Deployment, call: Call, *, stream: bool, request_id: str,
                 answering: Callable[[], None]) -> Fold | Started:
    """Open the answer and wait for its first event; a whole answer is folded here too, so
    a failure midway can still go to the next deployment (no byte has gone out). The time
    spent waiting on the upstream is added to `call.upstream_s`."""
    events = deployment.open(call, request_id=request_id)
    started = time.perf_counter()
    try:
        first = await anext(events)
    except StopAsyncIteration:
        raise UpstreamFailure(502, "the upstream ended the answer before sending anything",
                              code="upstream_error") from None
    except BaseException:
        await aclose(events)
        raise
    finally:
        call.upstream_s += time.perf_counter() - started
    if isinstance(first, Failed):
        await aclose(events)
        raise _failure(first)
    answering()
    if stream:
        return Started(first, events)
    whole = Fold(chat=call.chat)
    whole.add(first)
    started = time.perf_counter()
    try:
        await fold(events, into=whole)
    finally:
        call.upstream_s += time.perf_counter() - started
    if whole.failed is not None:
        raise _failure(whole.failed)
    if not whole.complete:
        raise UpstreamFailure(502, "the upstream ended the answer early", code="upstream_error")
    return whole


def _failure(event: Failed) -> UpstreamFailure | APIError:
    """A whole answer that broke: the deployment's failure (retried elsewhere, counted by its
    breaker), unless the request's own grammar broke it, which any deployment would repeat:
    that is the client's error, raised at once and held against no deployment, so no tenant's
    schema can open a breaker for everyone."""
    if event.code == GRAMMAR_ERROR:
        return APIError(event.status, event.message, type_="server_error", code=event.code)
    return UpstreamFailure(event.status if event.status >= 500 else 502, event.message,
                           code=event.code)


def _once(health: DeploymentHealth) -> Callable[[], None]:
    """Frees the deployment's concurrency slot when the answer is over, once."""
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            health.in_flight -= 1

    return release
