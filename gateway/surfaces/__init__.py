"""The APIs clients speak, each a parser in and a renderer out around the one request path.

A surface turns its body into the canonical request (OpenAI's chat or text completion, or an
embeddings request), and the answer's events (or a cached answer) back into its own JSON or
server-sent events. Its errors take its own shape (`gateway.errors.shaped`). Everything
between (authentication, routing, admission, the cache, dispatch, settlement) is
`gateway.request_path`, once; where a completion and an embedding differ there, the
surface's `Kind` says how, as data.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gateway.schemas.embeddings import EmbeddingRequest
from gateway.surfaces import anthropic, embeddings, responses
from workers.protocol.render import Fold, Renderer, StreamRenderer
from workers.protocol.requests import OpenAIRequest, RequestError, parse_request

if TYPE_CHECKING:
    from starlette.datastructures import Headers

    from gateway.deployments.base import AdapterRef, Call, Deployment
    from gateway.routing.fallback import Attempt
    from gateway.state import GatewayState
    from gateway.ticket import Ticket
    from tenancy.context import KeyContext

Canonical = OpenAIRequest | EmbeddingRequest  # what a surface's parser hands the path


@dataclass(frozen=True)
class Asks:
    """What the path reads from a canonical request besides its model."""

    stream: bool = False
    priority: int | None = None  # later within the tenant than its plan's (None: the plan's)
    logprobs: bool = False
    # The completion whose fields routing checks deployments against (tools, formats, its
    # cached prefix) and the response cache keys on; None: neither applies (an embedding).
    completion: OpenAIRequest | None = None


class Prepare(Protocol):
    """A deployment's call for the canonical request: every kind is given the same (`key`
    for the tenant and its plan's bounds, `adapter` the caller's LoRA where routing found
    one) and takes what it needs."""

    def __call__(self, deployment: Deployment, body: Any, *, chat: bool, key: KeyContext,
                 adapter: AdapterRef | None) -> Call: ...


@dataclass(frozen=True)
class Kind:
    """What a canonical request asks of the deployments, where a completion and an
    embedding differ; each stage of `request_path.answer` is otherwise one code for both."""

    mode: str  # which deployments serve it (`DeploymentRegistry.route`)
    asks: Callable[[Any], Asks]
    # Before admission, on a deployment that tokenizes: no tokenizer runs until admitted.
    estimate: Prepare
    prepare: Prepare  # exactly (the tokenizer runs off the event loop)
    attempt: Attempt | None = None  # one try on a deployment; None: open its events


def _completion_asks(body: OpenAIRequest) -> Asks:
    return Asks(stream=bool(body.stream), priority=body.priority,
                logprobs=body.wants_logprobs, completion=body)


def _estimate_completion(deployment: Deployment, body: OpenAIRequest, *, chat: bool,
                         key: KeyContext, adapter: AdapterRef | None) -> Call:
    return deployment.estimate(body, chat=chat, tenant_id=key.tenant_id, adapter=adapter)


def _prepare_completion(deployment: Deployment, body: OpenAIRequest, *, chat: bool,
                        key: KeyContext, adapter: AdapterRef | None) -> Call:
    return deployment.prepare(body, chat=chat, tenant_id=key.tenant_id, adapter=adapter)


COMPLETION = Kind("chat", _completion_asks, _estimate_completion, _prepare_completion)
# Nothing asked besides the model, so no response cache: an embedding is cheap to recompute.
EMBEDDING = Kind("embedding", lambda _body: Asks(), embeddings.estimate, embeddings.prepare,
                 embeddings.attempt)


@dataclass(frozen=True)
class Surface:
    name: str  # "chat", "completions", "messages", "responses", "embeddings"
    chat: bool  # the canonical request is a chat completion
    id_prefix: str
    parse: Callable[[bytes], Canonical]  # raises APIError (400) in the surface's words
    # (request, folded answer) as the surface's body; None: OpenAI's own (`Fold.response`)
    whole: Callable[[OpenAIRequest, Fold], dict[str, Any]] | None
    # (request, prompt tokens) -> renderer; None: never streamed (its kind asks no stream)
    stream: Callable[[OpenAIRequest, int], Renderer] | None = None
    api_key_header: str | None = None  # a header that may carry the key beside Authorization
    # The client's headers the surface checks and carries on the parsed request (Anthropic's
    # `anthropic-version` and `anthropic-beta`, for a native upstream): a 400 naming one.
    with_headers: Callable[[Canonical, Headers], Canonical] | None = None
    # A body that refers to what the gateway keeps for the tenant (Responses'
    # previous_response_id) is read with the key instead of `parse` (`request_path.read_body`).
    read: Callable[[GatewayState, KeyContext, bytes], Awaitable[OpenAIRequest]] | None = None
    # A finished answer the surface keeps (Responses' `store`), awaited before its last byte.
    keep: Callable[[Ticket, Fold], Awaitable[None]] | None = None
    kind: Kind = COMPLETION


def _openai_parse(chat: bool) -> Callable[[bytes], OpenAIRequest]:
    def parse(raw: bytes) -> OpenAIRequest:
        from gateway.errors import bad_request

        try:
            return parse_request(raw, chat=chat)
        except RequestError as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None
    return parse


def _anthropic_whole(_request: OpenAIRequest, fold: Fold) -> dict[str, Any]:
    return anthropic.whole(fold.response(), stop_sequence=fold.stop_sequence())


CHAT = Surface("chat", True, "chatcmpl", _openai_parse(True), None,
               lambda request, _: StreamRenderer(chat=True, include_usage=request.include_usage))
COMPLETIONS = Surface("completions", False, "cmpl", _openai_parse(False), None,
                      lambda request, _: StreamRenderer(chat=False,
                                                        include_usage=request.include_usage))
MESSAGES = Surface("messages", True, "msg", anthropic.parse, _anthropic_whole,
                   lambda request, prompt_tokens: anthropic.StreamRenderer(
                       prompt_tokens=prompt_tokens, model=request.model),
                   api_key_header="x-api-key", with_headers=anthropic.with_headers)
RESPONSES = Surface("responses", True, "resp", responses.parse, responses.whole,
                    responses.StreamRenderer, read=responses.read, keep=responses.keep)
EMBEDDINGS = Surface("embeddings", False, "emb", embeddings.parse, None, kind=EMBEDDING)
