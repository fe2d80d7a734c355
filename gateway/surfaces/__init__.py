"""The APIs clients speak, each a parser in and a renderer out around the one request path.

A surface turns its body into the canonical request (OpenAI's chat or text completion), and
the answer's events (or a cached answer) back into its own JSON or server-sent events. Its
errors take its own shape (`gateway.errors.shaped`). Everything between (authentication,
routing, admission, the cache, dispatch, settlement) is `gateway.request_path`, once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.surfaces import anthropic, responses
from workers.protocol.render import Fold, Renderer, StreamRenderer
from workers.protocol.requests import OpenAIRequest, RequestError, parse_request

if TYPE_CHECKING:
    from gateway.state import GatewayState
    from gateway.ticket import Ticket
    from tenancy.context import KeyContext


@dataclass(frozen=True)
class Surface:
    name: str  # "chat", "completions", "messages", "responses"
    chat: bool  # the canonical request is a chat completion
    id_prefix: str
    parse: Callable[[bytes], OpenAIRequest]  # raises APIError (400) in the surface's words
    # (request, folded answer) as the surface's body; None: OpenAI's own (`Fold.response`)
    whole: Callable[[OpenAIRequest, Fold], dict[str, Any]] | None
    stream: Callable[[OpenAIRequest, int], Renderer]  # (request, prompt tokens) -> renderer
    api_key_header: str | None = None  # a header that may carry the key beside Authorization
    # A body that refers to what the gateway keeps for the tenant (Responses'
    # previous_response_id) is read with the key instead of `parse` (`request_path.read_body`).
    read: Callable[[GatewayState, KeyContext, bytes], Awaitable[OpenAIRequest]] | None = None
    # A finished answer the surface keeps (Responses' `store`), awaited before its last byte.
    keep: Callable[[Ticket, Fold], Awaitable[None]] | None = None


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
                   api_key_header="x-api-key")
RESPONSES = Surface("responses", True, "resp", responses.parse, responses.whole,
                    responses.StreamRenderer, read=responses.read, keep=responses.keep)
