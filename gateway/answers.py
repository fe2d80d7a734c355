"""How an answer leaves the gateway: whole, streamed, or from the response cache.

Each renders the deployment's events (or the stored answer's) with the one renderer
(`workers.protocol.render`), settles the ticket before the last byte leaves, and keeps a whole
answer in the cache in the background. A surface that keeps its answers (Responses' `store`)
is handed each finished one before its last byte (`Surface.keep`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response, StreamingResponse

from gateway.response_cache import CacheUse, Hit, cacheable, fresh
from gateway.routing.fallback import Started
from gateway.surfaces import Surface
from gateway.ticket import Ticket
from workers.protocol.events import Failed, aclose
from workers.protocol.render import Fold, events_of_response, replay
from workers.protocol.requests import ChatCompletionRequest
from workers.protocol.wire_json import dumps

prompt_log = logging.getLogger("switchboard.prompts")  # only with `log_prompts` on
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def whole(ticket: Ticket, fold: Fold, use: CacheUse | None, headers: dict[str, str],
                surface: Surface) -> Response:
    response = fold.response()
    ticket.close("ok")
    keep(ticket, use, response)
    if ticket.gw.settings.log_prompts:
        log_completion(response)
    body = response if surface.whole is None else surface.whole(ticket.call.request, fold)
    if surface.keep is not None:
        await surface.keep(ticket, fold)
    return Response(_json(body), media_type="application/json", headers=headers)


def streamed(ticket: Ticket, answer: Started, use: CacheUse | None, headers: dict[str, str],
             surface: Surface) -> StreamingResponse:
    return StreamingResponse(_relay(ticket, answer, use, surface),
                             media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


async def _relay(ticket: Ticket, answer: Started, use: CacheUse | None, surface: Surface
                 ) -> AsyncIterator[bytes]:
    """The events as the surface's SSE. The usage is recorded before the last byte goes out;
    leaving early (the client is gone) closes the events, which aborts the upstream."""
    status = "aborted"
    request = ticket.call.request
    chat = isinstance(request, ChatCompletionRequest)
    renderer = surface.stream(request, ticket.call.prompt_tokens)
    log_prompts = ticket.gw.settings.log_prompts
    caching = use is not None and use.store
    # A renderer that folds the answer itself (Responses') lends its fold; else one is made
    # here where the cache, the prompt log or the surface's `keep` needs the whole answer.
    own: Fold | None = getattr(renderer, "fold", None)
    fold = own if own is not None else Fold(chat=chat) if caching or log_prompts \
        or surface.keep is not None else None
    broken = False
    events = answer.rest
    try:
        event = answer.first
        while True:
            if fold is not None and own is None:
                fold.add(event)
            raw = renderer.render(event)
            if raw:
                yield raw
            if isinstance(event, Failed):
                broken = True
                break
            try:
                event = await anext(events)
            except StopAsyncIteration:
                break
        status = "ok" if ticket.call.usage.finished and not broken else "error"
        ticket.close(status)
        if not broken:
            if surface.keep is not None and fold is not None and status == "ok":
                await surface.keep(ticket, fold)  # before the last byte, as the usage
            yield renderer.done()
    finally:
        try:
            await aclose(events)  # aborts the upstream if the client left
        finally:
            ticket.close(status)
    if (caching or log_prompts) and fold is not None and status == "ok" and fold.complete:
        response = fold.response()
        if log_prompts:
            log_completion(response)
        keep(ticket, use, response)


async def from_cache(ticket: Ticket, hit: Hit, response_id: str, headers: dict[str, str],
                     surface: Surface, *, stream: bool) -> Response:
    """A stored answer under this request's id, billed as wholly cached."""
    request = ticket.call.request
    body = fresh(hit, response_id=response_id, model=request.model)
    usage = body.get("usage") or {}
    metered = ticket.call.usage
    metered.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    metered.completion_tokens = int(usage.get("completion_tokens") or 0)
    metered.cached_tokens = metered.prompt_tokens
    # The whole prompt was served from cache, and is metered so.
    body["usage"] = {**usage, "prompt_tokens_details": {"cached_tokens": metered.prompt_tokens}}
    metered.finished = True
    ticket.cache_hit = hit.kind
    headers = {**headers, "x-cache": "hit", "x-cache-kind": hit.kind}
    if hit.similarity is not None:
        headers["x-cache-similarity"] = f"{hit.similarity:.4f}"
    events = events_of_response(body, chat=surface.chat)
    fold = None
    if surface.whole is not None or surface.keep is not None:
        fold = Fold(chat=surface.chat)
        for event in events:
            fold.add(event)
    if stream:
        chunks = replay(events, surface.stream(request, metered.prompt_tokens))
        return StreamingResponse(_replayed(ticket, chunks, surface, fold),
                                 media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    ticket.close("ok")
    if surface.whole is not None and fold is not None:
        body = surface.whole(request, fold)
    if surface.keep is not None and fold is not None:
        await surface.keep(ticket, fold)
    return Response(_json(body), media_type="application/json", headers=headers)


async def _replayed(ticket: Ticket, chunks: list[bytes], surface: Surface,
                    fold: Fold | None) -> AsyncIterator[bytes]:
    try:
        for chunk in chunks:
            if chunk is chunks[-1]:
                ticket.close("ok")  # recorded before the last event goes out
                if surface.keep is not None and fold is not None:
                    await surface.keep(ticket, fold)
            yield chunk
    finally:
        ticket.close("aborted")


def keep(ticket: Ticket, use: CacheUse | None, response: dict[str, Any]) -> None:
    """Store a whole answer in the response cache, in the background, with the usage billed."""
    if use is None or not use.store or not cacheable(response):
        return
    usage = ticket.call.usage
    stored = {**response, "usage": {  # a copy: `response` may still be on its way out
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens}}
    ticket.gw.spawn(ticket.gw.cache.store(use, stored))


def log_completion(response: dict[str, Any]) -> None:
    """The answer's text, for `log_prompts` only."""
    choices = [c.get("message", {}).get("content") if "message" in c else c.get("text")
               for c in response.get("choices") or []]
    prompt_log.info("completion", extra={"completion": choices})


def _json(body: dict[str, Any]) -> bytes:
    return dumps(body)
