"""An admitted completion, settled and metered exactly once however it ends: the limiter's
reservation trued up to the usage billed, one usage record, the request's metrics, span and
log line. How the answer reaches the client is `gateway.answers`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from billing.pricing import charge
from gateway.observability import tracing as attr
from gateway.observability.logs import note
from gateway.observability.tracing import annotate
from gateway.settlement import Settlement


@dataclass
class Ticket(Settlement):
    """An admitted request: settled and metered exactly once, however it ends.

    The usage record is written (to the meter's outbox) before the last byte of a successful
    answer leaves, so a response the client saw complete is never lost to a crash."""

    cache_hit: str = "none"

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
        )
        metrics = self.gw.metrics
        metrics.finished(
            tenant=self.key.tenant_id, status=status, cache=self.cache_hit,
            model=metrics.model_label(self.deployment.config.model_name,
                                      adapter=adapter is not None),
            prompt_tokens=billed_prompt, completion_tokens=usage.completion_tokens,
            cached_tokens=cached, cost_micros=cost.total_micros,
            ttft_s=None if self.clock.first is None else self.clock.first - self.clock.start,
            total_s=now - self.clock.start, streamed=bool(self.call.request.stream))
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
