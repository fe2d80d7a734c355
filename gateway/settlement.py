"""What every admitted request keeps until it is settled: its clock, the deployments it was
tried on, and the call whose usage is billed. Completions (`gateway.ticket.Ticket`) and
embeddings (`embeddings_path.EmbeddingBill`) settle differently; this part they share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from opentelemetry.trace import INVALID_SPAN, Span

from gateway.deployments.base import Call, Deployment
from gateway.observability.tracing import Dispatches
from tenancy.context import KeyContext
from tenancy.limits import AdmissionRequest

if TYPE_CHECKING:
    from gateway.routing.fallback import Served
    from gateway.state import GatewayState


@dataclass
class Clock:
    """When the request arrived, was dispatched and got its first byte (for usage records)."""

    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    start: float = field(default_factory=time.perf_counter)
    dispatch: float | None = None
    first: float | None = None

    def dispatched(self) -> None:
        self.dispatch = time.perf_counter()

    def first_byte(self) -> None:
        self.first = time.perf_counter()

    def ms(self, at: float | None) -> float | None:
        return None if at is None else round((at - self.start) * 1000, 3)


@dataclass
class Settlement:
    """An admitted request's attempts; the subclass settles and meters it once."""

    gw: GatewayState
    key: KeyContext
    deployment: Deployment
    call: Call
    admission: AdmissionRequest
    request_id: str
    clock: Clock
    calls: list[Call] = field(default_factory=list)
    release: Callable[[], None] = field(default=lambda: None, repr=False)
    closed: bool = False
    span: Span = field(default=INVALID_SPAN, repr=False)  # the request's
    dispatches: Dispatches = field(default_factory=lambda: Dispatches(None), repr=False)
    # Share of the normal price charged (a batch line: the plan's batch_price_percent).
    price_percent: int = 100

    def attempt(self, call: Call) -> None:
        """A deployment is being tried with `call` (usage is counted on the latest)."""
        self.dispatches.started(call)
        if call is not self.call:
            self.calls.append(self.call)
            self.call = call

    def served(self, served: Served) -> None:
        self.deployment = served.deployment
        self.attempt(served.call)
        self.release = served.release

    def upstream_s(self) -> float:
        return sum(c.upstream_s for c in (*self.calls, self.call))
