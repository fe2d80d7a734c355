"""Interjections: a short request of another tenant runs between two layers of a long step.

On CPU one step over a long prompt takes seconds; a tenant whose short request arrives
meanwhile would wait all of it for its first token. Instead the step in flight pauses at a
layer boundary, a step of the waiting requests that may interject
(`Scheduler.schedule_interjection`) runs and is answered at once, and the paused step then
resumes where it stopped, its tokens unchanged and its timing without the pause.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from workers.engine.outputs import RequestOutput
from workers.engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from workers.config import EngineArgs

DEFAULT_INTERJECT_TOKENS = 256  # EngineArgs.interject_tokens on CPU


class Arrivals(Protocol):
    """Where requests that arrive while a step runs come from, and where the outputs of the
    steps run for them go (the async engine; see `LLMEngine.step`)."""

    def admit(self, engine: Any) -> None:
        """Enqueue (`engine.enqueue`) what has arrived since the step began."""
        ...

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams now, before the step in flight ends."""
        ...


def interject_tokens(args: EngineArgs, runner: Any) -> int:
    """`interject_tokens`, with None resolved: on for CPU steps, which are long (a paused
    step costs nothing there); off on CUDA, where a step is short and the pause would
    synchronise the device mid-step."""
    if args.interject_tokens is not None:
        return args.interject_tokens
    device = getattr(runner, "device", None)
    return DEFAULT_INTERJECT_TOKENS if device is None or device.type == "cpu" else 0


class _Engine(Protocol):
    """What an interjection needs of the engine (`LLMEngine`)."""

    scheduler: Scheduler
    arrivals: Arrivals | None
    num_enqueued: int  # requests enqueued so far: did any arrive at this boundary?

    def run(self, sched: SchedulerOutput,
            between_layers: Callable[[], None] | None = None) -> list[RequestOutput]: ...


class Interjections:
    """The steps run inside the engine's steps: counted, and timed apart from them."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.count = 0
        self.seconds = 0.0  # spent inside other steps, in all (their timings leave it out)

    def hook(self, sched: SchedulerOutput) -> Callable[[], None] | None:
        """The step's `between_layers`: at its first layer boundary, and at each later one
        where requests arrived, a step for waiting requests may run (`_interject`)."""
        engine = self.engine
        config = engine.scheduler.config
        if (engine.arrivals is None or config.interject_tokens <= 0 or config.policy != "fair"
                or not sched.chunks):
            return None
        arrivals = engine.arrivals
        first = [True]

        def between_layers() -> None:
            enqueued = engine.num_enqueued
            arrivals.admit(engine)
            if first[0] or engine.num_enqueued != enqueued:
                first[0] = False
                self._interject(sched)

        return between_layers

    def _interject(self, in_flight: SchedulerOutput) -> None:
        engine = self.engine
        assert engine.arrivals is not None
        started = time.perf_counter()
        sched = engine.scheduler.schedule_interjection(in_flight)
        if sched.chunks:
            outputs = engine.run(sched)
            self.count += 1
            engine.arrivals.publish(outputs)
        self.seconds += time.perf_counter() - started
