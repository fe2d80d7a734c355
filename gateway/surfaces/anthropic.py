"""Anthropic's Messages API as a surface: its body parsed into the canonical chat request, the
answer's events rendered as its message (whole) or its server-sent events, errors in its shape.

Nothing else differs from chat completions: the same admission, cache, routing, dispatch and
settlement serve both (`gateway.request_path`). Tools reach the engine through the model's chat
template and grammar as OpenAI tools; `tool_use` / `tool_result` blocks become assistant
`tool_calls` and `tool` messages. What has no counterpart here (extended thinking, documents,
server tools) is a 400 naming it, never dropped.

The canonical request also carries the body as validated (`NATIVE_FIELDS`, never the client's
connection or account settings): a deployment whose upstream speaks Messages (an `openai`
deployment with `native_apis: [messages]`, a litellm `anthropic` provider) is sent that to its
`/messages` instead of chat completions, and its answer read into the same events
(`gateway.deployments.native`); every other deployment gets the translation.

Headers (`with_headers`, before routing): the client's `anthropic-version` and `anthropic-beta`
(comma-separated beta names, as the SDK's `betas=` and Claude Code send them; several lines
are merged in order, each name once) are checked, whatever the deployment: each name a token
of letters, digits, `.`, `_` and `-`, each header at most `MAX_HEADER_CHARS` in all, one
version; anything else is a 400 naming the header, so no other bytes are ever sent upstream.
A native Messages upstream is sent both with the call (the version in place of the default
`2023-06-01`, the betas after any the deployment's own headers name). A translated request
has no use for them: the engine, workers and chat upstreams serve no beta (what a beta
unlocks in the body, such as `thinking` or server tools, is refused by name as without it),
so they are not forwarded there, and a fallback from a native deployment to a translated one
drops them the same way. The response cache keys on both where given (a request with a beta
is never answered with one cached without it), and count_tokens checks them the same way.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.deployments.native import (
    BETA_HEADER,
    VERSION_HEADER,
    Native,
    NativeChat,
    merged_betas,
    with_client_headers,
    with_native,
)
from gateway.errors import APIError, anthropic_error_type
from workers.protocol.events import (
    Event,
    Failed,
    Finished,
    Opened,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from workers.protocol.render import sse_event
from workers.protocol.requests import ChatCompletionRequest, RequestError, request_error

if TYPE_CHECKING:
    from starlette.datastructures import Headers

PATH = "/v1/messages"
MAX_HEADER_CHARS = 1024  # one header's lines together (`anthropic-beta`, `anthropic-version`)
_NAME = re.compile(r"[A-Za-z0-9._-]+")  # a beta's name, or a version
R = TypeVar("R")
# What a Messages upstream is sent of a request, as validated (model and stream are set per
# call); `container` and `thinking` are refused, and the account's settings (workspace,
# region, diagnostics) are the deployment's, not the client's.
NATIVE_FIELDS = frozenset({"messages", "system", "max_tokens", "stop_sequences", "temperature",
                           "top_p", "top_k", "tools", "tool_choice", "metadata",
                           "output_config", "cache_control", "service_tier"})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Loose(BaseModel):
    """Blocks may carry fields this surface ignores (`cache_control`, `citations`)."""

    model_config = ConfigDict(strict=True, extra="allow")


class TextBlock(_Loose):
    type: Literal["text"]
    text: str


class ImageSource(_Loose):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Loose):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Loose):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    input: dict[str, Any]


class ToolResultBlock(_Loose):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


class OtherBlock(_Loose):
    """A block type this gateway does not serve (thinking, document, server tool results)."""

    type: str


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | OtherBlock


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class ToolDefinition(_Loose):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom", or a server tool's versioned type


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint, unused
    format: JsonOutputFormat | None = None


class MessagesRequest(_Strict):
    """The body of POST /v1/messages (and, less `max_tokens`, of count_tokens)."""

    model: Annotated[str, Field(min_length=1, max_length=512)]
    messages: Annotated[list[Message], Field(min_length=1, max_length=10_000)]
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[Annotated[str, Field(max_length=1_000)]],
                              Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # Accepted and refused by name when set to something this gateway cannot do.
    thinking: dict[str, Any] | None = None
    container: Any = None
    # Accepted, with nothing to do here: the engine's prefix cache is automatic, and there is
    # one speed, tier and region.
    cache_control: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def parse(raw: bytes, *, count_only: bool = False) -> ChatCompletionRequest:
    """The Messages body as the canonical chat request (400 in Anthropic's words otherwise)."""
    try:
        body = MessagesRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise _as_api_error(request_error(exc)) from None
    if body.max_tokens is None and not count_only:
        raise invalid("max_tokens: Field required", param="max_tokens")
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise invalid("Extended thinking ('thinking') is not supported by this gateway.",
                      param="thinking")
    if body.container is not None:
        raise invalid("Code execution containers ('container') are not supported by this "
                      "gateway.", param="container")
    try:
        chat = NativeChat.model_validate(_chat_body(body))
    except ValidationError as exc:
        raise _as_api_error(request_error(exc)) from None
    return with_native(chat, "messages", lambda: Native("messages", body.model_dump(
        mode="json", by_alias=True, exclude_none=True, include=NATIVE_FIELDS)))


def with_headers(request: R, headers: Headers) -> R:
    """The client's `anthropic-version` and `anthropic-beta` checked (a 400 naming the header
    otherwise) and carried on the request's native body, for an upstream that speaks
    Messages, and in its response cache key (`native.with_client_headers`). The Messages
    route and `/v1/messages/count_tokens` both check them here."""
    version = _version(headers.getlist(VERSION_HEADER))
    betas = _betas(headers.getlist(BETA_HEADER))
    if isinstance(request, NativeChat):
        with_client_headers(request, version, betas)
    return request


def _version(values: list[str]) -> str | None:
    if not values:
        return None
    given = {value.strip(" \t") for value in values}
    if len(given) > 1:
        raise invalid(f"{VERSION_HEADER}: give one version, not several.", param=VERSION_HEADER)
    (version,) = given
    if len(version) > MAX_HEADER_CHARS or not _NAME.fullmatch(version):
        raise invalid(f"{VERSION_HEADER}: not a valid API version (letters, digits, '.', '_' "
                      "and '-').", param=VERSION_HEADER)
    return version


def _betas(values: list[str]) -> tuple[str, ...]:
    if sum(len(value) for value in values) > MAX_HEADER_CHARS:
        raise invalid(f"{BETA_HEADER}: longer than {MAX_HEADER_CHARS} characters.",
                      param=BETA_HEADER)
    betas = merged_betas(values)
    if not all(_NAME.fullmatch(name) for name in betas):
        raise invalid(f"{BETA_HEADER}: expected beta names separated by commas (letters, "
                      "digits, '.', '_' and '-').", param=BETA_HEADER)
    return betas


def _chat_body(body: MessagesRequest) -> dict[str, Any]:
    chat: dict[str, Any] = {"model": body.model, "stream": body.stream,
                            "messages": _messages(body)}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # message_delta carries the usage
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        value = getattr(body, name)
        if value is not None:
            chat[name] = value
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    output = body.output_config
    if output is not None and output.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": output.format.schema_, "strict": True}}
    if body.metadata is not None and body.metadata.user_id is not None:
        chat["user"] = body.metadata.user_id
    if body.tools:
        chat["tools"] = [_tool(index, tool) for index, tool in enumerate(body.tools)]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise invalid("tool_choice.name: required when type is 'tool'",
                              param="tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif body.tools or choice.type == "none":
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use and body.tools:
            chat["parallel_tool_calls"] = False
    return chat


def _tool(index: int, tool: ToolDefinition) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise invalid(f"tools.{index}: the server tool '{tool.type}' is not supported by this "
                      "gateway; only custom tools (name, description, input_schema) are.",
                      param=f"tools.{index}.type")
    function: dict[str, Any] = {"name": tool.name,
                                "parameters": tool.input_schema or {"type": "object"}}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _messages(body: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n\n".join(
            block.text for block in body.system)
        out.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            out += _user_turn(index, message.content)
        else:
            out.append(_assistant_turn(index, message.content))
    return out


def _user_turn(index: int, blocks: list[Any]) -> list[dict[str, Any]]:
    """Tool results first (each a `tool` message, as they answer the previous turn's calls),
    then what the user said, as one message."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for k, block in enumerate(blocks):
        where = f"messages.{index}.content.{k}"
        if isinstance(block, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _result_text(block, where)})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
        else:
            raise _unsupported(block, where)
    if parts:
        results.append({"role": "user", "content": parts})
    return results


def _assistant_turn(index: int, blocks: list[Any]) -> dict[str, Any]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})
        else:
            raise _unsupported(block, f"messages.{index}.content.{k}")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text else None}
    if calls:
        turn["tool_calls"] = calls
    elif not text:
        turn["content"] = ""
    return turn


def _result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        pieces = []
        for part in content:
            if not isinstance(part, TextBlock):
                raise invalid(f"{where}: a tool_result may hold text only here.",
                              param=f"{where}.content")
            pieces.append(part.text)
        text = "\n".join(pieces)
    return f"Error: {text}" if block.is_error else text


def _image_url(block: ImageBlock, where: str) -> str:
    source = block.source
    if source.type == "url" and source.url:
        return source.url
    if source.type == "base64" and source.data and source.media_type:
        return f"data:{source.media_type};base64,{source.data}"
    raise invalid(f"{where}.source: an image needs a url, or base64 data with its media_type.",
                  param=f"{where}.source")


def _unsupported(block: Any, where: str) -> APIError:
    return invalid(f"{where}: content blocks of type '{block.type}' are not supported by this "
                   "gateway.", param=f"{where}.type")


# ---- answers -------------------------------------------------------------------------------

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "content_filter": "refusal", "function_call": "tool_use"}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if finish_reason == "stop" and stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


def message_id(response_id: str) -> str:
    return f"msg_{response_id.split('-', 1)[-1] or os.urandom(16).hex()}"


def _usage(usage: Usage | dict[str, Any] | None) -> dict[str, int]:
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    if isinstance(usage, dict):
        prompt = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        completion = int(usage.get("completion_tokens") or 0)
    else:
        prompt, cached, completion = usage.prompt_tokens, usage.cached_tokens, \
            usage.completion_tokens
    return {"input_tokens": prompt - cached, "output_tokens": completion,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def whole(response: dict[str, Any], *, stop_sequence: str | None = None) -> dict[str, Any]:
    """An OpenAI chat completion (the fold of the events) as an Anthropic message."""
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or _tool_id(),
                        "name": function.get("name") or "",
                        "input": _arguments(function.get("arguments") or "")})
    reason = choice.get("finish_reason")
    return {"id": message_id(str(response.get("id") or "")), "type": "message",
            "role": "assistant", "model": response.get("model") or "", "content": content,
            "stop_reason": stop_reason(reason, stop_sequence),
            "stop_sequence": stop_sequence if reason == "stop" else None,
            "usage": _usage(response.get("usage"))}


def _arguments(text: str) -> dict[str, Any]:
    """A tool call's JSON arguments as the object Anthropic's `input` is. Text cut short (the
    answer hit max_tokens) is kept under `_partial`, never lost."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"_partial": text}
    return value if isinstance(value, dict) else {"_value": value}


def _tool_id() -> str:
    return f"toolu_{os.urandom(12).hex()}"


class StreamRenderer:
    """One answer's events as Anthropic's stream: message_start, ping, then per content block
    content_block_start / _delta (text_delta, input_json_delta) / _stop, message_delta with
    the stop reason and usage, message_stop. `done()` closes it; a failure is an `error`."""

    def __init__(self, *, prompt_tokens: int, model: str) -> None:
        self._prompt_tokens = prompt_tokens
        self._model = model
        self._block = -1  # the index of the open block (-1: none yet)
        self._open: str | None = None  # its kind: "text" or "tool_use"
        self._reason: str | None = None
        self._stop_sequence: str | None = None
        self._usage: Usage | None = None
        self._started = False

    def render(self, event: Event) -> bytes:
        if isinstance(event, Opened):
            return self._start(event.id, event.model)
        out = b"" if self._started else self._start("", self._model)
        if isinstance(event, TextDelta) and event.index == 0:
            if not event.text:
                return out
            if self._open != "text":
                out += self._new_block({"type": "text", "text": ""}, "text")
            return out + sse_event("content_block_delta", {
                "type": "content_block_delta", "index": self._block,
                "delta": {"type": "text_delta", "text": event.text}})
        if isinstance(event, ToolCallDelta) and event.index == 0:
            if event.id is not None or self._open != "tool_use":
                out += self._new_block({"type": "tool_use", "id": event.id or _tool_id(),
                                        "name": event.name or "", "input": {}}, "tool_use")
            if event.arguments:
                out += sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": self._block,
                    "delta": {"type": "input_json_delta", "partial_json": event.arguments}})
            return out
        if isinstance(event, Finished) and event.index == 0:
            self._reason = event.reason
            self._stop_sequence = event.stop_sequence
        elif isinstance(event, Usage):
            self._usage = event
        elif isinstance(event, Failed):
            return out + sse_event("error", {"type": "error", "error": {
                "type": anthropic_error_type(event.status), "message": event.message}})
        return out

    def done(self) -> bytes:
        out = self._close_block()
        usage = _usage(self._usage)
        reason = self._reason
        out += sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(reason, self._stop_sequence),
                      "stop_sequence": self._stop_sequence if reason == "stop" else None},
            "usage": {"output_tokens": usage["output_tokens"]}})
        return out + sse_event("message_stop", {"type": "message_stop"})

    def _start(self, response_id: str, model: str) -> bytes:
        if self._started:
            return b""
        self._started = True
        message = {"id": message_id(response_id), "type": "message", "role": "assistant",
                   "model": model or self._model, "content": [], "stop_reason": None,
                   "stop_sequence": None,
                   "usage": {"input_tokens": self._prompt_tokens, "output_tokens": 0}}
        return (sse_event("message_start", {"type": "message_start", "message": message})
                + sse_event("ping", {"type": "ping"}))

    def _new_block(self, block: dict[str, Any], kind: str) -> bytes:
        out = self._close_block()
        self._block += 1
        self._open = kind
        return out + sse_event("content_block_start", {"type": "content_block_start",
                                                 "index": self._block, "content_block": block})

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self._block})


# ---- errors -------------------------------------------------------------------------------

def invalid(message: str, *, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request_error")


def _as_api_error(exc: RequestError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code)
