"""The request path of a completion, in order. Read this first.

    authenticate key (cached, no DB) -> read and validate the body -> route: the name (a
    model, an alias, `auto`, or the caller's own LoRA adapter) to the deployments to try, in
    policy order (cached, 404/403; only deployments that serve every field, else 400) ->
    estimate the call on the first whose context fits (no tokenizer runs) -> reserve limits
    and budget atomically (429) -> prepare it exactly (the engine tokenizes, in a thread;
    a refusal gives the reservation back) -> response cache lookup
    (exact, then semantic) -> dispatch with fallbacks until one deployment answers, streaming
    or not (a client that disconnects aborts upstream) -> settle the reservation to the real
    usage, meter it, and keep the answer in the cache.

The reservation is settled exactly once per admitted request, whatever happens after it.
With tracing on, each step is a span under the request's (`auth`, `route`, `prepare`,
`limits`, `cache`, and a `dispatch` per deployment tried); the request's log context learns
the tenant after `auth` and the outcome at settlement (docs/observability.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive

from billing.pricing import charge
from gateway.admission import admission_request, admit, ratelimit_headers
from gateway.deployments.base import Call, Deployment, prepared
from gateway.errors import APIError, bad_request
from gateway.observability import tracing as attr
from gateway.observability.logs import bind_tenant, note
from gateway.observability.tracing import annotate, current_span
from gateway.response_cache import CacheUse, Hit, cacheable, fresh
from gateway.routing.fallback import AllAttemptsFailed, TooLong
from gateway.routing.router import plan_route
from gateway.settlement import Clock, Settlement
from gateway.state import GatewayState
from workers.protocol.events import Event, Failed, aclose
from workers.protocol.render import DONE, Fold, StreamRenderer, events_of_response, replay
from workers.protocol.requests import (
    ChatCompletionRequest,
    OpenAIRequest,
    RequestError,
    parse_request,
    request_error,
)

T = TypeVar("T")
prompt_log = logging.getLogger("switchboard.prompts")  # only with `log_prompts` on
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
TIER_HEADER = "x-switchboard-tier"


async def serve_completion(request: Request, *, chat: bool) -> Response:
    clock = Clock()
    gw: GatewayState = request.app.state.gateway
    scope_state = request.scope["state"]
    tracing, span = gw.tracing, current_span()  # the request's span (GatewayMiddleware)
    with tracing.span("auth"):
        key = await gw.keys.tenant(request.headers.get("authorization"))
    bind_tenant(key.tenant_id)
    raw = await request.body()  # within max_body_bytes: the middleware counts what arrives
    body = parse_body(raw, chat=chat)
    annotate(span, {attr.TENANT_ID: key.tenant_id, attr.MODEL: body.model,
                    attr.STREAM: bool(body.stream)})
    if gw.settings.log_prompts:
        prompt_log.info("prompt", extra={"prompt": _prompt_of(body)})
    with tracing.span("route"):
        plan = await plan_route(gw.deployments, gw.adapters, key, body.model,
                                tier=asked_tier(request), logprobs=body.wants_logprobs,
                                request=body)
    dispatches = tracing.dispatches()

    def prepare(deployment: Deployment) -> Call:
        call = deployment.prepare(body, chat=chat, tenant_id=key.tenant_id,
                                  adapter=plan.adapter)
        dispatches.prepared(call, deployment.name)
        return call

    def estimate(deployment: Deployment) -> Call:
        if deployment.tokenizes:
            return deployment.estimate(body, chat=chat, tenant_id=key.tenant_id,
                                       adapter=plan.adapter)
        return prepare(deployment)

    with tracing.span("prepare"):
        order, call = await first_that_fits(plan.order, estimate, threaded=False)
    engine_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    admission = admission_request(request_id=engine_id, key=key, call=call,
                                  price=order[0].price)
    decision = await admit(gw, admission, key=key, model=order[0].config.model_name,
                           adapter=plan.adapter is not None)
    if order[0].tokenizes:  # admitted on an estimate: now the exact count, off the loop
        try:
            with tracing.span("prepare"):
                order, call = await first_that_fits(order, prepare)
        except BaseException:
            # never ran: give the reservation back
            gw.spawn(gw.limiter.settle(admission, tokens=0, cost_micros=0))
            raise
    headers = ratelimit_headers(decision)
    ticket = Ticket(gw, key, order[0], call, admission, scope_state["request_id"], clock,
                    span=span, dispatches=dispatches)
    try:
        with tracing.span("cache") as cache_span:
            use = gw.cache.use(request.headers, key, body, chat=chat, model_key=plan.model_key)
            hit = None if use is None else await gw.cache.lookup(use)
            annotate(cache_span, {attr.CACHE_HIT: "none" if hit is None else hit.kind})
        if use is not None and use.lookup:
            gw.metrics.cache_lookup(_looked_up(use, hit), None if hit is None else hit.kind)
        if hit is not None:
            return ticket.answer_from_cache(hit, engine_id, headers, stream=body.stream)
        headers["x-cache"] = "miss"
        clock.dispatched()
        work = gw.fallbacks.serve(order, call, stream=body.stream, request_id=engine_id,
                                  prepare=prepare, on_call=ticket.attempt)
        try:
            served = await until_done_or_disconnect(work, request.receive)
        finally:
            scope_state["upstream_s"] = ticket.upstream_s()
        if served is None:
            ticket.close("aborted")
            return Response(status_code=499)
        ticket.served(served)
        clock.first_byte()
        headers["x-switchboard-deployment"] = served.deployment.name
        headers["x-switchboard-attempts"] = str(served.attempts)
        if isinstance(served.result, Fold):
            response = served.result.response()
            ticket.close("ok")
            ticket.keep(use, response)
            if gw.settings.log_prompts:
                _log_completion(response)
            return Response(json.dumps(response, separators=(",", ":")).encode(),
                            media_type="application/json", headers=headers)
        return StreamingResponse(ticket.relay(served.result, use),
                                 media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    except AllAttemptsFailed as exc:
        ticket.close("error")
        raise exc.as_error(headers) from None
    except BaseException:
        ticket.close("error")
        raise


def _prompt_of(body: OpenAIRequest) -> Any:
    """What the caller asked, for `log_prompts` only: the messages or the prompt."""
    return body.model_dump(mode="json", include={"messages", "prompt"})


def _log_completion(response: dict[str, Any]) -> None:
    """The answer's text, for `log_prompts` only."""
    choices = [c.get("message", {}).get("content") if "message" in c else c.get("text")
               for c in response.get("choices") or []]
    prompt_log.info("completion", extra={"completion": choices})


def _looked_up(use: CacheUse, hit: Hit | None) -> list[str]:
    """The caches a lookup consulted: semantic only after an exact miss, and not when the
    prompt was too long to embed (the lookup then clears the scope)."""
    kinds = ["exact"] if use.exact_key is not None else []
    if (hit is not None and hit.kind == "semantic") or (
            hit is None and use.scope is not None and use.text is not None):
        kinds.append("semantic")
    return kinds


async def first_that_fits(order: list[Deployment], prepare: Callable[[Deployment], Call], *,
                          threaded: bool = True) -> tuple[list[Deployment], Call]:
    """The plan from the first deployment whose context window holds the prompt, and its call.

    A prompt too long for one deployment moves on to the next with a larger window; when none
    holds it, the client gets the first deployment's 400."""
    too_long = TooLong()
    for index, deployment in enumerate(order):
        if too_long.skips(deployment):
            continue
        try:
            call = await prepared(deployment, prepare) if threaded else prepare(deployment)
            return order[index:], call
        except APIError as exc:
            too_long.refused(deployment, exc)
    assert too_long.first is not None
    raise too_long.first


def asked_tier(request: Request) -> str | None:
    tier = request.headers.get(TIER_HEADER)
    if tier is None:
        return None
    tier = tier.strip()
    if not tier or len(tier) > 64:
        raise bad_request(f"Invalid {TIER_HEADER} header.", param=TIER_HEADER,
                          code="invalid_value")
    return tier


def parse_body(raw: bytes, *, chat: bool) -> OpenAIRequest:
    try:
        return parse_request(raw, chat=chat)
    except RequestError as exc:
        raise as_api_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the field."""
    return as_api_error(request_error(exc))


def as_api_error(exc: RequestError) -> APIError:
    return bad_request(str(exc), param=exc.param, code=exc.code)


async def until_done_or_disconnect(work: Awaitable[T], receive: Receive) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (aborting upstream) -> None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


@dataclass
class Ticket(Settlement):
    """An admitted request: settled and metered exactly once, however it ends.

    The usage record is written (to the meter's outbox) before the last byte of a successful
    answer leaves, so a response the client saw complete is never lost to a crash."""

    cache_hit: str = "none"

    def answer_from_cache(self, hit: Hit, response_id: str, headers: dict[str, str], *,
                          stream: bool) -> Response:
        request = self.call.request
        body = fresh(hit, response_id=response_id, model=request.model)
        usage = body.get("usage") or {}
        self.call.usage.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.call.usage.completion_tokens = int(usage.get("completion_tokens") or 0)
        self.call.usage.cached_tokens = self.call.usage.prompt_tokens
        # The whole prompt was served from cache, and is metered so.
        body["usage"] = {**usage, "prompt_tokens_details": {
            "cached_tokens": self.call.usage.prompt_tokens}}
        self.call.usage.finished = True
        self.cache_hit = hit.kind
        headers = {**headers, "x-cache": "hit", "x-cache-kind": hit.kind}
        if hit.similarity is not None:
            headers["x-cache-similarity"] = f"{hit.similarity:.4f}"
        if stream:
            chat = isinstance(request, ChatCompletionRequest)
            events = replay(events_of_response(body, chat=chat), chat=chat,
                            include_usage=request.include_usage)
            return StreamingResponse(self._replay(events), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **headers})
        self.close("ok")
        return Response(json.dumps(body, separators=(",", ":")).encode(),
                        media_type="application/json", headers=headers)

    async def _replay(self, events: list[bytes]) -> AsyncIterator[bytes]:
        try:
            for chunk in events:
                if chunk is events[-1]:
                    self.close("ok")  # recorded before the last event goes out
                yield chunk
        finally:
            self.close("aborted")

    async def relay(self, events: AsyncIterator[Event], use: CacheUse | None
                    ) -> AsyncIterator[bytes]:
        """The answer's events as SSE. The usage is recorded before the last byte goes out;
        leaving early (the client is gone) closes `events`, which aborts the upstream."""
        status = "aborted"
        request = self.call.request
        chat = isinstance(request, ChatCompletionRequest)
        renderer = StreamRenderer(chat=chat, include_usage=request.include_usage)
        log_prompts = self.gw.settings.log_prompts
        fold = Fold(chat=chat) if (use is not None and use.store) or log_prompts else None
        broken = False
        try:
            async for event in events:
                if fold is not None:
                    fold.add(event)
                raw = renderer.render(event)
                if isinstance(event, Failed):
                    broken = True
                    yield raw
                    break
                if raw:
                    yield raw
            status = "ok" if self.call.usage.finished and not broken else "error"
            self.close(status)
            if not broken:
                yield DONE
        finally:
            try:
                await aclose(events)  # aborts the upstream if the client left
            finally:
                self.close(status)
        if fold is not None and status == "ok" and fold.complete:
            response = fold.response()
            if log_prompts:
                _log_completion(response)
            self.keep(use, response)

    def keep(self, use: CacheUse | None, response: dict[str, Any]) -> None:
        """Store an answer in the response cache, in the background."""
        if use is None or not cacheable(response):
            return
        usage = self.call.usage
        response["usage"] = {"prompt_tokens": usage.prompt_tokens,
                             "completion_tokens": usage.completion_tokens,
                             "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        self.gw.spawn(self.gw.cache.store(use, response))

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
        cost = charge(self.deployment.price.rates(), prompt_tokens=billed_prompt,
                      completion_tokens=usage.completion_tokens, cached_tokens=cached,
                      markup_bp=plan.price_markup_bp,
                      share_percent=100 if self.cache_hit == "none"
                      else plan.cache_hit_price_percent)
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
