"""The endpoints a batch may target: each is a surface's parser (the same one its live route
uses) and the answer function of the request path, so a batch line is validated and answered
exactly as a live request would be."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from gateway.request_path import Origin, answer
from gateway.state import GatewayState
from gateway.surfaces import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, Surface
from gateway.surfaces import responses as responses_surface
from tenancy.context import KeyContext

Answer = Callable[[GatewayState, KeyContext, Any, Origin], Awaitable[Response]]
Read = Callable[[GatewayState, KeyContext, bytes], Awaitable[Any]]


@dataclass(frozen=True)
class Endpoint:
    url: str
    # The body checked as the live route checks it (APIError, 400, if not); its result is
    # the request answered, unless `read` builds that with the key (Responses'
    # previous_response_id: the tenant's stored responses are read when the line runs).
    parse: Callable[[bytes], Any]
    answer: Answer
    read: Read | None = None


def _surface(surface: Surface) -> Answer:
    async def run(gw: GatewayState, key: KeyContext, body: Any, origin: Origin) -> Response:
        return await answer(gw, key, body, surface, origin)
    return run


ENDPOINTS: dict[str, Endpoint] = {
    endpoint.url: endpoint for endpoint in (
        Endpoint("/v1/chat/completions", CHAT.parse, _surface(CHAT)),
        Endpoint("/v1/completions", COMPLETIONS.parse, _surface(COMPLETIONS)),
        Endpoint("/v1/embeddings", EMBEDDINGS.parse, _surface(EMBEDDINGS)),
        Endpoint("/v1/responses", responses_surface.validate, _surface(RESPONSES),
                 read=responses_surface.read),
    )
}
