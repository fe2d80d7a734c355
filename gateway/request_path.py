"""The request path of a completion, in order. Read this first.

    authenticate key (cached, no DB) -> read and validate the body -> resolve the model to a
    deployment, or to the caller's own LoRA adapter on one (cached, 404/403) -> prepare the
    call (exact prompt tokens, context check) -> reserve limits and budget atomically (429)
    -> [cache lookup: later] -> dispatch (registering the adapter with the engine on first
    use), streaming or not (client disconnect aborts upstream) -> settle the reservation to
    the real usage and meter it.

The reservation is settled exactly once per admitted request, whatever happens after it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive

from gateway.admission import admission_request, ratelimit_headers, refusal
from gateway.deployments.base import (
    AdapterRef,
    Call,
    Deployment,
    UpstreamFailure,
    engine_adapter_name,
)
from gateway.errors import APIError, bad_request, forbidden, model_not_found, too_large
from gateway.schemas.openai import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from gateway.state import GatewayState
from tenancy.context import KeyContext
from tenancy.limits import AdmissionRequest

T = TypeVar("T")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def serve_completion(request: Request, *, chat: bool) -> Response:
    gw: GatewayState = request.app.state.gateway
    scope_state = request.scope["state"]
    key = await gw.keys.tenant(request.headers.get("authorization"))
    raw = await read_body(request, gw.settings.max_body_bytes)
    body = parse_body(raw, chat=chat)
    deployment, adapter = await resolve(gw, key, body.model)
    call = deployment.prepare(body, chat=chat, tenant_id=key.tenant_id, adapter=adapter)
    engine_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    admission = admission_request(request_id=engine_id, key=key, call=call,
                                  config=deployment.config)
    decision = await gw.limiter.admit(admission)
    if not decision.admitted:
        raise refusal(decision)
    headers = ratelimit_headers(decision)
    ticket = Ticket(gw, key, deployment, call, admission, scope_state["request_id"])
    try:
        # Until the answer (or, streaming, its first token) is there, a client that leaves
        # cancels the upstream call.
        work = (deployment.open_stream if body.stream else deployment.complete)(
            call, request_id=engine_id)
        try:
            result = await until_done_or_disconnect(work, request.receive)
        finally:
            scope_state["upstream_s"] = call.upstream_s
        if result is None:
            ticket.close("aborted")
            return Response(status_code=499)
        if body.stream:
            return StreamingResponse(ticket.relay(result), media_type="text/event-stream",
                                     headers={**SSE_HEADERS, **headers})
        ticket.close("ok")
        return Response(result, media_type="application/json", headers=headers)
    except UpstreamFailure as exc:
        ticket.close("error")
        extra = {"retry-after": exc.retry_after} if exc.retry_after else {}
        raise APIError(exc.status, exc.message, type_="server_error", code=exc.code,
                       headers={**headers, **extra}) from None
    except BaseException:
        ticket.close("error")
        raise


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing chunked bodies that grow past the limit."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def parse_body(raw: bytes, *, chat: bool) -> OpenAIRequest:
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False)[0]
    if first["type"] in ("json_invalid", "json_type"):
        return bad_request("We could not parse the JSON body of your request: "
                           f"{first['msg']}.", code="invalid_json")
    loc = [str(p) for p in first["loc"] if not _is_type_tag(str(p))]
    param = ".".join(loc[:4])
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    if first["type"] == "model_type" and not loc:
        return bad_request("The request body must be a JSON object.", code="invalid_type")
    return bad_request(f"Invalid value for '{param}': {first['msg']}.", param=param or None,
                       code="invalid_value")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_type_tag(part: str) -> bool:
    """pydantic puts union branch names ('str', 'list[int]', ...) in error locations."""
    return part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "constrained-"))


async def resolve(gw: GatewayState, key: KeyContext, model: str
                  ) -> tuple[Deployment, AdapterRef | None]:
    """The deployment to use, and the caller's adapter on it if `model` names one.

    404 for models that don't exist; another tenant's adapter is exactly that, one the caller
    cannot tell from a name nobody registered. 403 for ones the key or plan may not use."""
    chain = gw.deployments.route(model)
    if chain:
        return pick_deployment(key, chain, model, asked=model), None
    adapter = await gw.adapters.find(key.tenant_id, model)  # this tenant's only; cached
    if adapter is None:
        raise model_not_found(model)
    if not key.may_use_adapter(adapter.name):
        raise forbidden(f"Your API key is not allowed to use the adapter '{adapter.name}'.",
                        code="adapter_not_allowed")
    chain = [d for d in gw.deployments.route(adapter.base_model) if d.serves_adapters]
    deployment = pick_deployment(key, chain, adapter.base_model, asked=model)
    ref = AdapterRef(adapter.id, engine_adapter_name(key.tenant_id, adapter.name),
                     adapter.path, adapter.pinned)
    return deployment, ref


def pick_deployment(key: KeyContext, chain: list[Deployment], base: str, *, asked: str
                    ) -> Deployment:
    """The first deployment of `chain` (those of `base`) the key may use."""
    if not chain:
        raise model_not_found(asked)
    if not key.may_use_model(base):
        raise forbidden(f"Your API key is not allowed to use the model '{base}'.",
                        code="model_not_allowed")
    allowed = [d for d in chain if key.may_use_tier(d.config.tier)]
    if not allowed:
        raise forbidden(f"Your plan does not include the tier that serves '{base}'.",
                        code="tier_not_allowed")
    return allowed[0]


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
class Ticket:
    """An admitted request: settled and metered exactly once, however it ends."""

    gw: GatewayState
    key: KeyContext
    deployment: Deployment
    call: Call
    admission: AdmissionRequest
    request_id: str
    closed: bool = False

    async def relay(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        status = "aborted"
        try:
            async for chunk in chunks:
                yield chunk
            status = "ok" if self.call.usage.finished else "error"
        finally:
            try:
                await _close_quietly(chunks)  # aborts the upstream if the client left
            finally:
                self.close(status)

    def close(self, status: str) -> None:
        if self.closed:
            return
        self.closed = True
        usage = self.call.usage
        billed_prompt = usage.prompt_tokens if (usage.completion_tokens or usage.finished) else 0
        cost = self.deployment.config.cost_micros(billed_prompt, usage.completion_tokens)
        tokens = billed_prompt + usage.completion_tokens
        self.gw.meter.record(
            request_id=self.request_id, tenant_id=self.key.tenant_id, key_id=self.key.key_id,
            model=self.call.request.model, deployment=self.deployment.name,
            prompt_tokens=billed_prompt, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens, cost_micros=cost, status=status,
        )
        # Settling awaits the limiter; run it on its own so a cancelled request still settles.
        task = asyncio.get_running_loop().create_task(
            self.gw.limiter.settle(self.admission, tokens=tokens, cost_micros=cost)
        )
        self.gw.background.add(task)
        task.add_done_callback(self.gw.background.discard)


async def _close_quietly(chunks: AsyncIterator[bytes]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
