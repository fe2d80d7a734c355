"""An admitted request, of any surface, settled and metered exactly once however it ends:
the limiter's reservation trued up to the usage billed, one usage record, the request's
metrics, span and log line. How the answer reaches the client is `gateway.answers`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING

from opentelemetry.trace import INVALID_SPAN, Span

from billing.pricing import charge
from gateway.deployments.base import Call, Deployment
from gateway.observability import tracing as attr
from gateway.observability.logs import note
from gateway.observability.tracing import Dispatches, annotate
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
class Ticket:
    """An admitted request: its attempts, settled and metered exactly once, however it ends.

    One rule bills every kind: the prompt (an embedding's inputs) and the completion tokens
    its usage holds, at the deployment's prices. An embedding's usage has no completion
    tokens, so it pays the input price only; cut short, it pays for the rows computed, which
    the deployment keeps as `computed_prompt_tokens` as an engine does for a prompt.

    The usage record is written (to the meter's outbox) before the last byte of a successful
    answer leaves, so a response the client saw complete is never lost to a crash."""

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
    batch_id: str | None = None  # a batch line's batch, named on its usage record
    streamed: bool = False  # the answer goes out as server-sent events
    cache_hit: str = "none"

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

    def close(self, status: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.release()
        usage = self.call.usage
        # An answer cut short before its first token still pays for the prompt work done,
        # where the deployment reports it (the engine does); TPM settles on the same count.
        billed_prompt = usage.prompt_tokens if (usage.completion_tokens or usage.finished) \
            else min(usage.computed_prompt_tokens or 0, usage.prompt_tokens)
        plan = self.key.plan
        # Prefix-cache tokens only: an answer from the response cache is priced in full, then
        # scaled by the plan's share for hits.
        cached = usage.cached_tokens if billed_prompt and self.cache_hit == "none" else 0
        # A batch line pays the plan's batch share of what a live request would.
        share = 100 if self.cache_hit == "none" else plan.cache_hit_price_percent
        cost = charge(self.deployment.price.rates(), prompt_tokens=billed_prompt,
                      completion_tokens=usage.completion_tokens, cached_tokens=cached,
                      markup_bp=plan.price_markup_bp,
                      share_percent=share if self.price_percent == 100
                      else Decimal(share * self.price_percent) / 100)
        adapter = self.call.adapter
        now = time.perf_counter()
        self.gw.meter.record(
            request_id=self.request_id, tenant_id=self.key.tenant_id, key_id=self.key.key_id,
            model=self.call.request.model,
            deployment="" if self.cache_hit != "none" else self.deployment.name,
            adapter="" if adapter is None else adapter.engine_name.split("/", 1)[-1],
            tier=self.deployment.config.tier,
            prompt_tokens=billed_prompt, completion_tokens=usage.completion_tokens,
            cached_tokens=cached, input_cost_micros=cost.input_micros,
            output_cost_micros=cost.output_micros,
            cached_cost_micros=cost.cached_micros, cost_micros=cost.total_micros,
            price_id=self.deployment.price.price_id, status=status, cache_hit=self.cache_hit,
            queue_ms=self.clock.ms(self.clock.dispatch or now),
            ttft_ms=self.clock.ms(self.clock.first or now), total_ms=self.clock.ms(now),
            started_at=self.clock.started_at, created_at=datetime.now(UTC),
            batch_id=self.batch_id,
            batch_price_percent=None if self.batch_id is None else self.price_percent,
        )
        metrics = self.gw.metrics
        metrics.finished(
            tenant=self.key.tenant_id, status=status, cache=self.cache_hit,
            model=metrics.model_label(self.deployment.config.model_name,
                                      adapter=adapter is not None),
            prompt_tokens=billed_prompt, completion_tokens=usage.completion_tokens,
            cached_tokens=cached, cost_micros=cost.total_micros,
            ttft_s=None if self.clock.first is None else self.clock.first - self.clock.start,
            total_s=now - self.clock.start, streamed=self.streamed)
        self._report(status, prompt_tokens=billed_prompt, cached_tokens=cached,
                     cost_micros=cost.total_micros)
        # Settling awaits the limiter; run it on its own so a cancelled request still settles.
        self.gw.spawn(self.gw.limiter.settle(
            self.admission, tokens=billed_prompt + usage.completion_tokens,
            cost_micros=cost.total_micros))

    def _report(self, status: str, *, prompt_tokens: int, cached_tokens: int,
                cost_micros: int) -> None:
        """The outcome on the request's span and its log line (ids and counts, no text)."""
        self.dispatches.finish(status)
        deployment = "" if self.cache_hit != "none" else self.deployment.name
        completion_tokens = self.call.usage.completion_tokens
        annotate(self.span, {
            attr.STATUS: status, attr.DEPLOYMENT: deployment or None,
            attr.CACHE_HIT: self.cache_hit, attr.ATTEMPTS: self.dispatches.attempts,
            attr.INPUT_TOKENS: prompt_tokens, attr.OUTPUT_TOKENS: completion_tokens,
            attr.CACHED_TOKENS: cached_tokens})
        note(model=self.call.request.model, deployment=deployment, outcome=status,
             cache=self.cache_hit, prompt_tokens=prompt_tokens,
             completion_tokens=completion_tokens, cached_tokens=cached_tokens,
             cost_micros=cost_micros, ttft_ms=self.clock.ms(self.clock.first))
