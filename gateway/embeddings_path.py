"""The request path of an embeddings request, in order: the completions path's steps, reused.

    authenticate key (cached) -> read and validate the body -> route: the name to the embedding
    deployments to try (the router's own key, plan and tier checks, over embedding
    deployments only) -> estimate the call (no tokenizer runs) and admit it as completions
    do (429) -> prepare it exactly on the first whose window holds every input (the model in
    this process tokenizes, in a thread, once) and reserve the exact count
    (`admission.admit_exactly`, 429) -> dispatch with fallbacks until one deployment
    answers (a client that disconnects aborts it) -> settle the reservation to the real input
    tokens and meter them.

There is no response cache and no stream: an embedding is cheap to recompute and comes whole.
The reservation is settled exactly once per admitted request, whatever happens after it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import cast

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from billing.pricing import charge
from gateway.admission import (
    admission_request,
    admit,
    admit_exactly,
    counted_if_refused,
    ratelimit_headers,
    refuse_if_held,
)
from gateway.deployments.base import Call, Deployment
from gateway.deployments.embedding import (
    EmbeddingDeployment,
    estimated_embedding_call,
    not_an_embedding_model,
    wrong_endpoint,
)
from gateway.deployments.registry import DeploymentRegistry, Route
from gateway.observability import tracing as attr
from gateway.observability.logs import bind_tenant, note
from gateway.observability.tracing import annotate, current_span
from gateway.request_path import (
    Origin,
    asked_tier,
    engine_share,
    first_that_fits,
    until_done_or_disconnect,
    validation_error,
)
from gateway.routing.fallback import AllAttemptsFailed
from gateway.routing.health import DeploymentHealth
from gateway.routing.router import plan_route
from gateway.schemas.embeddings import EmbeddingRequest, check_inputs
from gateway.settlement import Clock, Settlement
from gateway.state import GatewayState
from tenancy.context import KeyContext


async def serve_embeddings(request: Request) -> Response:
    """One HTTP embeddings request: who is asking and what, then `answer_embeddings`."""
    clock = Clock()
    gw: GatewayState = request.app.state.gateway
    span = current_span()
    with gw.tracing.span("auth"):
        key = await gw.keys.tenant(request.headers.get("authorization"))
    bind_tenant(key.tenant_id)
    await refuse_if_held(gw, request, key)  # a key over its RPM: its body is not parsed
    async with counted_if_refused(gw, key):  # a 4xx from here on counts for RPM
        body = parse_body(await request.body())  # within max_body_bytes (the middleware)
    origin = Origin(headers=request.headers, receive=request.receive,
                    state=request.scope["state"], span=span, clock=clock)
    return await answer_embeddings(gw, key, body, origin)


async def answer_embeddings(gw: GatewayState, key: KeyContext, body: EmbeddingRequest,
                            origin: Origin) -> Response:
    """A parsed embeddings request answered: route, fit, admit (two steps), dispatch, and
    settle, each once. A batch line comes here without a client (`origin.receive` None)."""
    clock, scope_state = origin.clock, origin.state
    tracing, span = gw.tracing, origin.span
    async with counted_if_refused(gw, key):  # a 4xx until admission counts for RPM
        annotate(span, {attr.TENANT_ID: key.tenant_id, attr.MODEL: body.model, attr.STREAM: False})
        with tracing.span("route"):
            plan = await plan_route(cast(DeploymentRegistry, EmbeddingRoutes(gw.deployments)),
                                    gw.adapters, key, body.model,
                                    tier=asked_tier(origin.headers),
                                    logprobs=False)
        if not isinstance(plan.order[0], EmbeddingDeployment):
            raise not_an_embedding_model(body.model)
        dispatches = tracing.dispatches()
        share = engine_share(key.tenant_id, key.plan, origin.priority)

        def prepare(deployment: Deployment) -> Call:
            if not isinstance(deployment, EmbeddingDeployment):
                raise not_an_embedding_model(body.model)
            call = deployment.prepare_embedding(
                body, plan_bound=key.plan.embedding_max_request_tokens)
            call.share = share
            dispatches.prepared(call, deployment.name)
            return call

        def estimate(deployment: Deployment) -> Call:
            if deployment.tokenizes:  # no tokenizer before the cheap checks
                return estimated_embedding_call(body)
            return prepare(deployment)

        with tracing.span("prepare"):
            order, call = await first_that_fits(plan.order, estimate, threaded=False)
    request_id = f"emb-{uuid.uuid4().hex}"
    admission = admission_request(request_id=request_id, key=key, call=call,
                                  price=order[0].price,
                                  exact=not order[0].tokenizes)
    model = order[0].config.model_name
    decision = await admit(gw, admission, key=key, model=model, adapter=False)
    if order[0].tokenizes:  # admitted on an estimate: now the exact count, off the loop
        try:
            with tracing.span("prepare"):
                order, call = await first_that_fits(order, prepare)
        except BaseException:
            gw.spawn(gw.limiter.settle(admission, tokens=0, cost_micros=0))
            raise
        admission, decision = await admit_exactly(
            gw, admission, call=call, price=order[0].price, key=key, model=model,
            adapter=False)
    headers = ratelimit_headers(decision)
    bill = EmbeddingBill(gw, key, order[0], call, admission, scope_state["request_id"], clock,
                         span=span, dispatches=dispatches, price_percent=origin.price_percent)
    try:
        clock.dispatched()
        work = gw.fallbacks.serve(order, call, stream=False, request_id=request_id,
                                  prepare=prepare, on_call=bill.attempt, run=_embed)
        try:
            served = await until_done_or_disconnect(work, origin.receive)
        finally:
            scope_state["upstream_s"] = bill.upstream_s()
        if served is None:
            bill.close("aborted")
            return Response(status_code=499)
        bill.served(served)
        clock.first_byte()
        assert isinstance(served.result, bytes)
        bill.close("ok")
        headers["x-switchboard-deployment"] = served.deployment.name
        headers["x-switchboard-attempts"] = str(served.attempts)
        return Response(served.result, media_type="application/json", headers=headers)
    except AllAttemptsFailed as exc:
        bill.close("error")
        raise exc.as_error(headers) from None
    except BaseException:
        bill.close("error")
        raise


def parse_body(raw: bytes) -> EmbeddingRequest:
    """The body, or a 400 naming what is wrong with it (worded as the completions path's)."""
    try:
        body = EmbeddingRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    check_inputs(body.inputs())
    return body


class EmbeddingRoutes:
    """The registry as the router sees it for embeddings: a name's embedding deployments
    (`auto` and aliases included), so key scopes, tiers, health and policy apply unchanged."""

    def __init__(self, registry: DeploymentRegistry) -> None:
        self._registry = registry

    def route(self, model: str) -> Route:
        return self._registry.route(model, mode="embedding")

    def health(self, name: str) -> DeploymentHealth:
        return self._registry.health(name)


@dataclass
class EmbeddingBill(Settlement):
    """An admitted embeddings request: settled and metered exactly once, however it ends.

    Input tokens only: the usage record has no completion tokens and is priced at the
    deployment's input price (with the plan's markup), like any other row of the ledger, so
    usage reports, exports and invoices show it beside completions.

    Work done is billed however the request ends: a request cut short (the client left, the
    route timed out, the model failed midway) pays for the tokens of the inputs computed, as
    the deployment kept them in `call.usage.prompt_tokens` (the model in this process counts
    them row by row; an upstream says nothing until it answers, so 0)."""

    def close(self, status: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.release()
        usage = self.call.usage
        tokens = min(usage.prompt_tokens, self.call.prompt_tokens) if not usage.finished \
            else usage.prompt_tokens
        cost = charge(self.deployment.price.rates(), prompt_tokens=tokens, completion_tokens=0,
                      markup_bp=self.key.plan.price_markup_bp, share_percent=self.price_percent)
        now = time.perf_counter()
        model = self.call.request.model
        self.gw.meter.record(
            request_id=self.request_id, tenant_id=self.key.tenant_id, key_id=self.key.key_id,
            model=model, deployment=self.deployment.name, adapter="",
            tier=self.deployment.config.tier, prompt_tokens=tokens, completion_tokens=0,
            cached_tokens=0, input_cost_micros=cost.input_micros, output_cost_micros=0,
            cached_cost_micros=0, cost_micros=cost.total_micros,
            price_id=self.deployment.price.price_id, status=status, cache_hit="none",
            queue_ms=self.clock.ms(self.clock.dispatch or now),
            ttft_ms=self.clock.ms(self.clock.first or now), total_ms=self.clock.ms(now),
            started_at=self.clock.started_at, created_at=datetime.now(UTC),
        )
        metrics = self.gw.metrics
        metrics.finished(
            tenant=self.key.tenant_id, status=status, cache="none",
            model=metrics.model_label(self.deployment.config.model_name, adapter=False),
            prompt_tokens=tokens, completion_tokens=0, cached_tokens=0,
            cost_micros=cost.total_micros, ttft_s=None, total_s=now - self.clock.start,
            streamed=False)
        self.dispatches.finish(status)
        annotate(self.span, {
            attr.STATUS: status, attr.DEPLOYMENT: self.deployment.name,
            attr.CACHE_HIT: "none", attr.ATTEMPTS: self.dispatches.attempts,
            attr.INPUT_TOKENS: tokens, attr.OUTPUT_TOKENS: 0, attr.CACHED_TOKENS: 0})
        note(model=model, deployment=self.deployment.name, outcome=status, cache="none",
             prompt_tokens=tokens, completion_tokens=0, cached_tokens=0,
             cost_micros=cost.total_micros)
        # Settling awaits the limiter; run it on its own so a cancelled request still settles.
        self.gw.spawn(self.gw.limiter.settle(self.admission, tokens=tokens,
                                                cost_micros=cost.total_micros))


async def _embed(deployment: Deployment, call: Call, *, stream: bool, request_id: str,
                 answering: Callable[[], None]) -> bytes:
    """One attempt at the embeddings body (the fallbacks' `run`)."""
    if not isinstance(deployment, EmbeddingDeployment):
        raise wrong_endpoint(call.request.model)
    # Once the deployment is computing (its first inputs done) the route's deadline no longer
    # cuts it: as for a completion's first event, a request making progress runs to its end.
    return await deployment.embed(call, request_id=request_id, answering=answering)
