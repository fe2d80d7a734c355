"""The request path of every surface's request, in order. Read this first.

    authenticate key (cached, no DB) -> a key or tenant refused for RPM a moment ago gets the
    429 again, its body dropped unparsed (`gateway.recent_refusals`) -> read and validate the
    body (from here to admission a 4xx still counts for RPM: `admission.counted_if_refused`) ->
    route: the name (a model, an alias, `auto`, or the caller's own LoRA adapter) to the
    deployments to try, in policy order (cached, 404/403; only deployments that serve every
    field, else 400) -> estimate the call on the first whose context fits (no tokenizer runs) ->
    admit it: RPM and concurrency reserved, the estimate checked against TPM and budget (429; an
    upstream that does not tokenize here reserves the estimate) -> prepare it exactly (the
    engine tokenizes, in a thread, once: the engine reuses the ids) and reserve the exact count,
    atomically against TPM and budget (`admission.admit_exactly`; a refusal, 429, gives the
    request's slot back) -> response cache lookup (exact, then semantic) -> dispatch with
    fallbacks until one deployment's answer begins (its first event; a whole answer is folded
    there too; a client that disconnects aborts upstream) -> render it (`gateway.answers`: JSON,
    or SSE as the events come) -> settle the reservation to the real usage, meter it
    (`gateway.ticket`), and keep the answer in the cache.

An embeddings request walks the same stages, each once; its surface's `Kind` says where it
differs: its deployments are the `mode: embedding` ones, nothing but the model is routed on,
the plan's `embedding_max_request_tokens` bounds its preparing, one try is one `embed` whose
answer comes whole and already rendered, and there is no response cache (and no `cache` span).

The reservation is settled exactly once per admitted request, whatever happens after it.
With tracing on, each step is a span under the request's (`auth`, `route`, `prepare`,
`limits`, `cache`, and a `dispatch` per deployment tried); the request's log context learns
the tenant after `auth` and the outcome at settlement (docs/observability.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from opentelemetry.trace import INVALID_SPAN, Span
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.routing import Route as HttpRoute
from starlette.types import Receive, Scope, Send

from gateway import answers
from gateway.admission import (
    admission_request,
    admit,
    admit_exactly,
    counted_if_refused,
    ratelimit_headers,
    refuse_if_held,
)
from gateway.deployments.base import Call, Deployment, EngineShare, prepared
from gateway.deployments.registry import DeploymentRegistry, Route
from gateway.errors import APIError, bad_request
from gateway.observability import tracing as attr
from gateway.observability.logs import bind_tenant
from gateway.observability.tracing import annotate, current_span
from gateway.response_cache import CacheUse, Hit
from gateway.routing.fallback import AllAttemptsFailed, Started, TooLong
from gateway.routing.health import DeploymentHealth
from gateway.routing.router import plan_route
from gateway.state import GatewayState
from gateway.surfaces import Canonical, Surface
from gateway.ticket import Clock, Ticket
from tenancy.context import KeyContext, PlanLimits
from workers.protocol.render import Fold
from workers.protocol.requests import OpenAIRequest, RequestError, request_error

T = TypeVar("T")
prompt_log = logging.getLogger("switchboard.prompts")  # only with `log_prompts` on
TIER_HEADER = "x-switchboard-tier"


def engine_share(tenant_id: str, plan: PlanLimits, asked: int | None) -> EngineShare:
    """Whom the engines charge, from the key alone, and at what priority within the tenant:
    the plan's unless the request asks for a later one (a larger value). The plan's priority
    is the most urgent a request may ask; more urgent is a 400 naming `priority`."""
    if asked is not None and asked < plan.priority:
        raise bad_request(f"priority {asked} is more urgent than this key's plan allows "
                          f"({plan.priority}); send {plan.priority} or more",
                          param="priority")
    return EngineShare(tenant_id, plan.engine_weight,
                       plan.priority if asked is None else asked)


class SurfaceEndpoint:
    """A surface's POST as a plain ASGI app. FastAPI's route machinery (its nested router
    matching, dependency solving and per-route exception wrapper) cost more per request than
    the rest of the framework together, for endpoints that take the raw request and need none
    of it; errors still reach the app's handlers (its exception middleware)."""

    def __init__(self, surface: Surface) -> None:
        self.surface = surface

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await serve(Request(scope, receive), self.surface)
        await response(scope, receive, send)


class SurfaceRoute(HttpRoute):
    """A plain route that names itself in the scope, as FastAPI's routes do: the request's
    span and metrics take its template (`workers.telemetry.serve_traced`)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.FULL:
            child["route"] = self
        return match, child


def surface_route(path: str, surface: Surface) -> SurfaceRoute:
    """`POST path` served by `serve` on `surface`, for the app's top level (`create_app`
    puts these first, so they are matched before any router)."""
    return SurfaceRoute(path, SurfaceEndpoint(surface), methods=["POST"], name=surface.name)


async def serve(request: Request, surface: Surface) -> Response:
    """One HTTP request on `surface` (chat, completions, Anthropic messages, OpenAI
    responses, embeddings), start to end: who is asking and what, then `answer`."""
    clock = Clock()
    gw: GatewayState = request.app.state.gateway
    span = current_span()  # the request's span (GatewayMiddleware)
    with gw.tracing.span("auth"):
        key = await gw.keys.tenant(credentials(request, surface))
    bind_tenant(key.tenant_id)
    await refuse_if_held(gw, request, key)  # a key over its RPM: its body is not parsed
    async with counted_if_refused(gw, key):  # a 4xx from here on counts for RPM
        raw = await request.body()  # within max_body_bytes: the middleware counts what arrives
        body = await read_body(gw, key, raw, surface, request.headers)
    origin = Origin(headers=request.headers, receive=request.receive,
                    state=request.scope["state"], span=span, clock=clock)
    return await answer(gw, key, body, surface, origin)


@dataclass
class Origin:
    """Where a canonical request came from: its HTTP headers (tier, cache control), the
    client's channel (to notice it leave), the request's state (its id, upstream time), span
    and clock. A batch line has no client (`receive` None), runs at `priority`, pays
    `price_percent` of the normal price and names its batch on its usage record."""

    headers: Mapping[str, str]
    receive: Receive | None
    state: dict[str, Any]
    span: Span = INVALID_SPAN
    clock: Clock = field(default_factory=Clock)
    priority: int | None = None  # overrides the body's (batch work runs last)
    price_percent: int = 100  # share of the normal price charged (a batch line's discount)
    batch_id: str | None = None  # a batch line's batch


async def answer(gw: GatewayState, key: KeyContext, body: Canonical, surface: Surface,
                 origin: Origin) -> Response:
    """A parsed request answered: route, fit, admit (two steps), cache, dispatch, render, and
    settle, each once. Where the surface's kind of request differs (an embedding), its
    `Kind` says how; no stage asks which surface it serves."""
    kind, chat = surface.kind, surface.chat
    tracing, span, clock, scope_state = gw.tracing, origin.span, origin.clock, origin.state
    asks = kind.asks(body)
    async with counted_if_refused(gw, key):  # a 4xx until admission counts for RPM
        annotate(span, {attr.TENANT_ID: key.tenant_id, attr.MODEL: body.model,
                        attr.STREAM: asks.stream})
        if gw.settings.log_prompts:
            prompt_log.info("prompt", extra={"prompt": _prompt_of(body)})
        with tracing.span("route"):
            plan = await plan_route(cast(DeploymentRegistry, Routes(gw.deployments, kind.mode)),
                                    gw.adapters, key, body.model,
                                    tier=asked_tier(origin.headers),
                                    logprobs=asks.logprobs, request=asks.completion)
        dispatches = tracing.dispatches()
        share = engine_share(key.tenant_id, key.plan, asks.priority
                             if origin.priority is None else origin.priority)

        def prepare(deployment: Deployment) -> Call:
            call = kind.prepare(deployment, body, chat=chat, key=key, adapter=plan.adapter)
            call.share = share
            dispatches.prepared(call, deployment.name)
            return call

        def estimate(deployment: Deployment) -> Call:
            if deployment.tokenizes:  # no tokenizer before the cheap checks and admission
                call = kind.estimate(deployment, body, chat=chat, key=key,
                                     adapter=plan.adapter)
                call.share = share
                return call
            return prepare(deployment)

        with tracing.span("prepare"):
            order, call = await first_that_fits(plan.order, estimate, threaded=False)
    engine_id = f"{surface.id_prefix}-{os.urandom(16).hex()}"
    admission = admission_request(request_id=engine_id, key=key, call=call,
                                  price=order[0].price,
                                  exact=not order[0].tokenizes)
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
        admission, decision = await admit_exactly(
            gw, admission, call=call, price=order[0].price, key=key,
            model=order[0].config.model_name, adapter=plan.adapter is not None)
    headers = ratelimit_headers(decision)
    ticket = Ticket(gw, key, order[0], call, admission, scope_state["request_id"], clock,
                    span=span, dispatches=dispatches, price_percent=origin.price_percent,
                    batch_id=origin.batch_id, streamed=asks.stream)
    try:
        use: CacheUse | None = None
        if asks.completion is not None:  # the response cache keeps completions only
            use, hit = await _cache(gw, origin, key, asks.completion, chat=chat,
                                    model_key=plan.model_key)
            if hit is not None:
                return await answers.from_cache(ticket, hit, engine_id, headers, surface,
                                                stream=asks.stream)
            headers["x-cache"] = "miss"
        clock.dispatched()
        work = gw.fallbacks.serve(order, call, stream=asks.stream, request_id=engine_id,
                                  prepare=prepare, on_call=ticket.attempt, run=kind.attempt)
        try:
            served = await until_done_or_disconnect(work, origin.receive)
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
            return await answers.whole(ticket, served.result, use, headers, surface)
        if isinstance(served.result, Started):
            return answers.streamed(ticket, served.result, use, headers, surface)
        ticket.close("ok")  # a body the deployment rendered whole (an embeddings answer)
        return Response(served.result, media_type="application/json", headers=headers)
    except AllAttemptsFailed as exc:
        ticket.close("error")
        raise exc.as_error(headers) from None
    except BaseException:
        ticket.close("error")
        raise


async def _cache(gw: GatewayState, origin: Origin, key: KeyContext, body: OpenAIRequest, *,
                 chat: bool, model_key: str) -> tuple[CacheUse | None, Hit | None]:
    """The response cache's use for this request (None: none applies) and its hit, counted."""
    with gw.tracing.span("cache") as cache_span:
        use = gw.cache.use(origin.headers, key, body, chat=chat, model_key=model_key)
        hit = None if use is None else await gw.cache.lookup(use)
        annotate(cache_span, {attr.CACHE_HIT: "none" if hit is None else hit.kind})
    if use is not None and use.lookup:
        gw.metrics.cache_lookup(_looked_up(use, hit), None if hit is None else hit.kind)
    return use, hit


class Routes:
    """The registry as the router sees it for one kind of request: a name's deployments of
    that mode (`auto` and aliases included), so key scopes, tiers, health and policy apply
    to embeddings unchanged."""

    def __init__(self, registry: DeploymentRegistry, mode: str) -> None:
        self._registry = registry
        self._mode = mode

    def route(self, model: str) -> Route:
        return self._registry.route(model, mode=self._mode)

    def health(self, name: str) -> DeploymentHealth:
        return self._registry.health(name)


def _prompt_of(body: Canonical) -> Any:
    """What the caller asked, for `log_prompts` only: the messages, the prompt or the
    inputs to embed."""
    return body.model_dump(mode="json", include={"messages", "prompt", "input"})


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


def asked_tier(headers: Mapping[str, str]) -> str | None:
    tier = headers.get(TIER_HEADER)
    if tier is None:
        return None
    tier = tier.strip()
    if not tier or len(tier) > 64:
        raise bad_request(f"Invalid {TIER_HEADER} header.", param=TIER_HEADER,
                          code="invalid_value")
    return tier


def parse_body(raw: bytes, *, surface: Surface) -> Canonical:
    """The surface's body as the canonical request, or a 400 naming the field at fault."""
    return surface.parse(raw)


async def read_body(gw: GatewayState, key: KeyContext, raw: bytes, surface: Surface,
                    headers: Headers) -> Canonical:
    """`parse_body`, or for a surface whose body refers to what the gateway keeps for the
    tenant (Responses' previous_response_id) its own reader, scoped to the key's tenant;
    then the client headers the surface checks and carries (Anthropic's version and betas)."""
    if surface.read is None:
        body = parse_body(raw, surface=surface)
    else:
        body = await surface.read(gw, key, raw)
    if surface.with_headers is not None:
        body = surface.with_headers(body, headers)
    return body


def credentials(request: Request, surface: Surface) -> str | None:
    """The Authorization header, or the surface's own key header (Anthropic's `x-api-key`)."""
    authorization = request.headers.get("authorization")
    if authorization is None and surface.api_key_header is not None:
        key = request.headers.get(surface.api_key_header)
        if key is not None:
            return f"Bearer {key}"
    return authorization


def validation_error(exc: ValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the field."""
    return as_api_error(request_error(exc))


def as_api_error(exc: RequestError) -> APIError:
    return bad_request(str(exc), param=exc.param, code=exc.code)


async def until_done_or_disconnect(work: Awaitable[T], receive: Receive | None) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (aborting upstream) -> None.
    Without a client (`receive` None: a batch line) it just runs."""
    if receive is None:
        return await work
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
