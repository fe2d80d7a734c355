"""OpenAI's Responses API as a surface: its body parsed into the canonical chat request, the
answer's events rendered as its Response object (whole) or its typed server-sent events, and
the answer kept for the tenant (`store`, the default) so `previous_response_id`, `GET` and
`DELETE /v1/responses/{id}` find it (`tenancy.stored_responses`).

Nothing else differs from chat completions: the same admission, cache, routing, dispatch and
settlement serve both (`gateway.request_path`). A deployment whose upstream serves Responses
(an `openai` deployment with `native_apis: [responses]`, a litellm `openai` provider at
OpenAI's own endpoint) is sent the request as a Responses body (`Native`, built here from the
validated fields: the conversation expanded into input items, `store: false`, never
`previous_response_id` or `metadata`, as the gateway keeps the responses) and its answer is read
into the same events (`gateway.deployments.native`); the response id, the stored copy and the
rendering stay the gateway's. Every other deployment gets it translated to chat: input items
become chat messages
(`function_call` items an assistant message's `tool_calls`, `function_call_output` items
`tool` messages); `instructions` a system message first; `text.format` the response format;
`max_output_tokens` max_tokens. A continuation (`previous_response_id`) is the stored
response's conversation (its history, input and output) followed by the new input; the
previous `instructions` are not carried over, as OpenAI does.

What has no counterpart here is a 400 naming it, never dropped: built-in tools (web_search,
file_search, computer use, code_interpreter, mcp, image_generation, ...), `background`,
`conversation`, prompt templates, `truncation: "auto"`, input files and items that refer to
server-side state (`item_reference`, reasoning items). `reasoning.effort` (other than "none")
is passed on as chat's `reasoning_effort`: deployments that take it honour it, the engine
refuses it by name; no reasoning items or summaries are produced (`reasoning_tokens` is 0).
`metadata` is kept with the stored response and echoed, not sent to the model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from gateway.deployments.native import Native, NativeChat, with_native
from gateway.errors import APIError, bad_request, not_found
from tenancy import stored_responses
from workers.protocol.events import (
    Event,
    Failed,
    OtherDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from workers.protocol.render import Fold
from workers.protocol.requests import (
    ChatCompletionRequest,
    FunctionName,
    Name,
    OpenAIRequest,
    RequestError,
    request_error,
)
from workers.protocol.wire_json import dumps

if TYPE_CHECKING:
    from gateway.state import GatewayState
    from gateway.ticket import Ticket
    from tenancy.context import KeyContext


PATH = "/v1/responses"
# What `include` may name: output text logprobs are given; the rest concern items (built-in
# tool calls, reasoning) this gateway never produces, so there is nothing to add for them.
INCLUDABLE = ("file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", "message.output_text.logprobs")
LOGPROBS = "message.output_text.logprobs"
# What a Responses upstream is sent of a request's own fields, as validated; `input` (the whole
# conversation), `tools` and `store: false` are added (`native_body`), model and stream per call.
NATIVE_FIELDS = frozenset({
    "instructions", "tool_choice", "text", "max_output_tokens", "temperature", "top_p",
    "top_logprobs", "parallel_tool_calls", "user", "safety_identifier", "prompt_cache_key",
    "reasoning", "include", "truncation", "service_tier", "max_tool_calls",
    "prompt_cache_retention"})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class _Loose(BaseModel):
    """Items and parts may carry fields this surface ignores (`status`, `phase`, ...)."""

    model_config = ConfigDict(strict=True, extra="allow")


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # nothing is obfuscated here


class ResponsesRequest(_Strict):
    """The body of POST /v1/responses."""

    model: Annotated[str, Field(min_length=1, max_length=512)]
    input: str | Annotated[list[dict[str, Any]], Field(max_length=10_000)] | None = None
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    parallel_tool_calls: bool | None = None
    user: Name | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1_024)] | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    background: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None  # bounds built-in tools: none
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # a hint, unused
    # Accepted, and refused by name when set.
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None


class FunctionTool(_Loose):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class MessageItem(_Loose):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[dict[str, Any]], Field(max_length=10_000)]


class TextPart(_Loose):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Loose):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Loose):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class FunctionCallItem(_Loose):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: FunctionName
    arguments: str


class FunctionCallOutputItem(_Loose):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[dict[str, Any]]


@dataclass
class Turn:
    """What a Responses request carries beside its chat request: the response's id and
    creation time, the parameters its Response object echoes, and the items it keeps."""

    response_id: str
    created_at: int
    model: str
    echo: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]] = field(default_factory=list)
    previous_response_id: str | None = None
    store: bool = True
    logprobs: bool = False
    completed_at: int | None = None
    answer: dict[str, Any] | None = None  # the finished Response, once made (whole, kept)

    @property
    def hex(self) -> str:
        return self.response_id.removeprefix("resp_")


class ResponsesChat(NativeChat):
    """The canonical chat request of a Responses request, carrying its `Turn` (and its native
    body)."""

    _turn: Turn | None = PrivateAttr(default=None)


def turn_of(request: OpenAIRequest) -> Turn:
    turn = getattr(request, "_turn", None)
    if turn is None:
        raise TypeError("not a Responses request")
    return turn


# ---- requests ------------------------------------------------------------------------------

def validate(raw: bytes) -> ResponsesRequest:
    """The body checked (400 naming the field), with what this gateway refuses by name."""
    try:
        body = ResponsesRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise as_api_error(request_error(exc)) from None
    for name, what in (("conversation", "Conversations"), ("prompt", "Prompt templates"),
                       ("context_management", "Context management")):
        if getattr(body, name) is not None:
            raise bad_request(f"{what} ('{name}') are not supported by this gateway; send the "
                              "input (and previous_response_id) instead.", param=name)
    if body.background:
        raise bad_request("Background responses are not supported by this gateway.",
                          param="background")
    if body.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported by this gateway: a prompt too "
                          "long for the model is a 400.", param="truncation")
    for index, name in enumerate(body.include or ()):
        if name not in INCLUDABLE:
            raise bad_request(f"Invalid value for 'include.{index}': '{name}'.",
                              param=f"include.{index}")
    if body.input is None and body.previous_response_id is None:
        raise bad_request("Missing required parameter: 'input'.", param="input",
                          code="missing_required_parameter")
    return body


def parse(raw: bytes) -> ChatCompletionRequest:
    """A body that continues no stored response as the canonical chat request
    (`previous_response_id` needs the tenant: `read`)."""
    body = validate(raw)
    if body.previous_response_id is not None:
        raise bad_request("previous_response_id needs the tenant's stored responses.",
                          param="previous_response_id")
    return build(body, history=[])


async def read(gw: GatewayState, key: KeyContext, raw: bytes) -> ChatCompletionRequest:
    """The body as the canonical chat request, continuing the tenant's stored response where
    it names one (another tenant's, or a deleted one, is a 404)."""
    body = validate(raw)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await kept(gw).find(body.previous_response_id, key.tenant_id)
        if previous is None:
            raise not_found(f"Previous response with id '{body.previous_response_id}' not "
                            "found.", param="previous_response_id")
        history = [*previous.history, *previous.input_items,
                   *(previous.body.get("output") or [])]
    return build(body, history=history)


def build(body: ResponsesRequest, *, history: list[dict[str, Any]]) -> ResponsesChat:
    """The chat request of a checked body after `history` (the items it continues)."""
    response_id = stored_responses.new_response_id()
    calls = {item["call_id"] for item in history if item.get("type") == "function_call"}
    items = input_items(body.input, calls)
    tools = [_tool(index, tool) for index, tool in enumerate(body.tools or ())]
    logprobs = LOGPROBS in (body.include or ()) or bool(body.top_logprobs)
    chat: dict[str, Any] = {
        "model": body.model, "stream": body.stream,
        "messages": chat_messages(body.instructions, [*history, *items])}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # the final event carries usage
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier",
                 "prompt_cache_key", "service_tier"):
        value = getattr(body, name)
        if value is not None:
            chat[name] = value
    if tools:
        chat["tools"] = [{"type": "function", "function": {
            k: v for k, v in tool.items() if k != "type" and v is not None}} for tool in tools]
    choice = _tool_choice(body.tool_choice, chat)
    if choice is not None and (tools or choice not in ("auto", "none")):
        chat["tool_choice"] = choice  # without tools, only a choice that needs them is sent
    if not tools:
        chat.pop("parallel_tool_calls", None)  # nothing to call: echoed, not sent
    text = body.text
    if text is not None and text.format is not None and text.format.type != "text":
        chat["response_format"] = _response_format(text.format)
    if text is not None and text.verbosity is not None:
        chat["verbosity"] = text.verbosity
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort not in (None, "none"):
        chat["reasoning_effort"] = "high" if effort == "xhigh" else effort
    if logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0
    try:
        request = ResponsesChat.model_validate(chat)
    except ValidationError as exc:
        raise as_api_error(request_error(exc)) from None
    request._turn = Turn(
        response_id=response_id, created_at=int(time.time()), model=body.model,
        echo=_echo(body, tools), input_items=items, history=history,
        previous_response_id=body.previous_response_id,
        store=body.store is not False, logprobs=logprobs)
    with_native(request, lambda: native_body(body, [*history, *items], tools))
    return request


def native_body(body: ResponsesRequest, conversation: list[dict[str, Any]],
                tools: list[dict[str, Any]]) -> Native:
    """The request for an upstream that serves Responses: its validated fields, the whole
    conversation as input items (without the gateway's item ids and statuses), and
    `store: false` (the gateway keeps the response, so the upstream keeps nothing and is never
    asked for one it does not have)."""
    sent = body.model_dump(mode="json", by_alias=True, exclude_none=True,
                           include=NATIVE_FIELDS)
    sent["input"] = [{k: v for k, v in item.items() if k not in ("id", "status")}
                     for item in conversation]
    if tools:
        sent["tools"] = [{k: v for k, v in tool.items() if v is not None} for tool in tools]
    sent["store"] = False
    return Native("responses", sent)


def _echo(body: ResponsesRequest, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The request's parameters as the Response object gives them back (OpenAI's defaults
    where not sent)."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    text.setdefault("format", {"type": "text"})
    reasoning = body.reasoning
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None if reasoning is None else reasoning.effort,
                      "summary": None if reasoning is None else (
                          reasoning.summary or reasoning.generate_summary)},
        "service_tier": "default", "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": text, "tool_choice": body.tool_choice or "auto", "tools": tools,
        "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "user": body.user, "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key}


def _tool(index: int, raw: dict[str, Any]) -> dict[str, Any]:
    kind = raw.get("type")
    if kind != "function":
        raise bad_request(f"tools.{index}: the tool type '{kind}' is not supported by this "
                          "gateway; only function tools (type 'function', name, parameters) "
                          "are.", param=f"tools.{index}.type")
    try:
        tool = FunctionTool.model_validate(raw)
    except ValidationError as exc:
        raise as_api_error(request_error(exc), prefix=f"tools.{index}") from None
    return {"type": "function", "name": tool.name, "description": tool.description,
            "parameters": tool.parameters, "strict": tool.strict}


def _tool_choice(choice: str | dict[str, Any] | None, chat: dict[str, Any]) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("Missing required parameter: 'tool_choice.name'.",
                              param="tool_choice.name", code="missing_required_parameter")
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        mode, allowed = choice.get("mode"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list):
            raise bad_request("tool_choice 'allowed_tools' needs a mode ('auto' or "
                              "'required') and a list of tools.", param="tool_choice")
        names = {t.get("name") for t in allowed if isinstance(t, dict)
                 and t.get("type") == "function"}
        if len(names) != len(allowed):
            raise bad_request("tool_choice.tools: only function tools ({'type': 'function', "
                              "'name': ...}) may be allowed here.", param="tool_choice.tools")
        chat["tools"] = [t for t in chat.get("tools") or () if t["function"]["name"] in names]
        return mode
    raise bad_request(f"tool_choice: the tool type '{kind}' is not supported by this gateway; "
                      "only 'none', 'auto', 'required', a function or allowed_tools are.",
                      param="tool_choice.type")


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None:
        raise bad_request("Missing required parameter: 'text.format.name'.",
                          param="text.format.name", code="missing_required_parameter")
    if fmt.schema_ is None:
        raise bad_request("Missing required parameter: 'text.format.schema'.",
                          param="text.format.schema", code="missing_required_parameter")
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def input_items(given: str | list[dict[str, Any]] | None, calls: set[str]
                ) -> list[dict[str, Any]]:
    """The input as Responses items in one shape (as they are stored and listed): messages
    with typed content parts, function calls and their outputs, each with an id. `calls`:
    the call ids before them (a function_call_output must answer one)."""
    if given is None:
        return []
    if isinstance(given, str):
        return [_message("user", [{"type": "input_text", "text": given}])]
    out = []
    for index, raw in enumerate(given):
        where = f"input.{index}"
        kind = raw.get("type", "message")
        try:
            if kind == "message":
                out.append(_message_item(MessageItem.model_validate(raw), where))
            elif kind == "function_call":
                call = FunctionCallItem.model_validate(raw)
                calls.add(call.call_id)
                out.append({"type": "function_call", "id": _id(raw, "fc"),
                            "call_id": call.call_id, "name": call.name,
                            "arguments": call.arguments, "status": "completed"})
            elif kind == "function_call_output":
                result = FunctionCallOutputItem.model_validate(raw)
                if result.call_id not in calls:
                    raise bad_request(f"No tool call found for function call output with "
                                      f"call_id '{result.call_id}'.", param=f"{where}.call_id")
                out.append({"type": "function_call_output", "id": _id(raw, "fco"),
                            "call_id": result.call_id,
                            "output": _output_text(result.output, where),
                            "status": "completed"})
            else:
                raise bad_request(f"{where}: input items of type '{kind}' are not supported by "
                                  "this gateway; send messages, function_call and "
                                  "function_call_output items.", param=f"{where}.type")
        except ValidationError as exc:
            raise as_api_error(request_error(exc), prefix=where) from None
    return out


def _message_item(item: MessageItem, where: str) -> dict[str, Any]:
    if isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        return _message(item.role, [_text_part(kind, item.content)])
    parts = []
    for index, raw in enumerate(item.content):
        at = f"{where}.content.{index}"
        kind = raw.get("type")
        try:
            if kind in ("input_text", "output_text"):
                part = TextPart.model_validate(raw)
                parts.append(_text_part(part.type, part.text))
            elif kind == "refusal" and item.role == "assistant":
                parts.append({"type": "refusal",
                              "refusal": RefusalPart.model_validate(raw).refusal})
            elif kind == "input_image" and item.role == "user":
                image = ImagePart.model_validate(raw)
                if not image.image_url:
                    raise bad_request(f"{at}: an image needs an image_url (a URL or a data "
                                      "URL); files are not served by this gateway.",
                                      param=f"{at}.image_url")
                parts.append({"type": "input_image", "image_url": image.image_url,
                              "detail": image.detail or "auto"})
            else:
                raise bad_request(f"{at}: content parts of type '{kind}' are not supported "
                                  f"by this gateway in a {item.role} message.",
                                  param=f"{at}.type")
        except ValidationError as exc:
            raise as_api_error(request_error(exc), prefix=at) from None
    return _message(item.role, parts)


def _text_part(kind: str, text: str) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _message(role: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{os.urandom(16).hex()}", "role": role,
            "status": "completed", "content": content}


def _id(raw: dict[str, Any], prefix: str) -> str:
    given = raw.get("id")
    return given if isinstance(given, str) and given else f"{prefix}_{os.urandom(16).hex()}"


def _output_text(output: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(output, str):
        return output
    pieces = []
    for index, raw in enumerate(output):
        if raw.get("type") not in ("input_text", "output_text") or not isinstance(
                raw.get("text"), str):
            raise bad_request(f"{where}.output.{index}: a function_call_output may hold text "
                              "only here.", param=f"{where}.output.{index}")
        pieces.append(raw["text"])
    return "".join(pieces)


def chat_messages(instructions: str | None, items: list[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """Items (in their stored shape) as chat messages, `instructions` first as the system
    message. Function calls join the assistant message before them (the turn's text), or
    make one; each output is a `tool` message."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:
        kind = item.get("type")
        if kind == "message":
            out.append(_chat_message(item["role"], item["content"]))
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": item["output"]})
    return out


def _chat_message(role: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    texts = [p["text"] for p in content if p["type"] in ("input_text", "output_text")]
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        refusal = "".join(p["refusal"] for p in content if p["type"] == "refusal")
        if refusal:
            message["refusal"] = refusal
            message["content"] = message["content"] or None
        return message
    if len(content) == 1 and texts:
        return {"role": role, "content": texts[0]}
    parts: list[dict[str, Any]] = []
    for part in content:
        if part["type"] == "input_image":
            image = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": part["text"]})
    return {"role": role, "content": parts}


# ---- answers -------------------------------------------------------------------------------

def status_of(reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The Response's status and incomplete_details for a chat finish reason."""
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            # cache writes cost nothing extra here (the engine's prefix cache is automatic)
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def error_json(failed: Failed) -> dict[str, Any]:
    code = "rate_limit_exceeded" if failed.status == 429 else "server_error"
    return {"code": code, "message": failed.message}


def response_object(turn: Turn, *, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, model: str | None = None,
                    incomplete: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    finished = status in ("completed", "incomplete", "failed")
    if finished and turn.completed_at is None:
        turn.completed_at = int(time.time())
    return {"id": turn.response_id, "object": "response", "created_at": turn.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "model": model or turn.model, "output": output,
            "usage": usage, "completed_at": turn.completed_at if status == "completed"
            else None, **turn.echo}


def message_id(turn: Turn, n: int = 0) -> str:
    return f"msg_{turn.hex}" if n == 0 else f"msg_{turn.hex}_{n}"


def call_item_id(turn: Turn, k: int) -> str:
    return f"fc_{turn.hex}_{k}"


def _text_content(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": list(logprobs or [])}


def output_of(turn: Turn, fold: Fold) -> tuple[list[dict[str, Any]], str, dict[str, Any] | None]:
    """A folded answer's output items, status and incomplete_details: its message (text, a
    refusal), then its function calls, the last item incomplete where the answer is."""
    response = fold.response()
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status, incomplete = status_of(choice.get("finish_reason"))
    items: list[dict[str, Any]] = []
    text, refusal = message.get("content") or "", message.get("refusal")
    calls = message.get("tool_calls") or []
    if text or refusal or not calls:
        content = []
        if text or not refusal:
            logprobs = (choice.get("logprobs") or {}).get("content") if turn.logprobs else None
            content.append(_text_content(text, logprobs))
        if refusal:
            content.append({"type": "refusal", "refusal": refusal})
        items.append({"type": "message", "id": message_id(turn), "status": "completed",
                      "role": "assistant", "content": content})
    for k, call in enumerate(calls):
        function = call.get("function") or {}
        items.append({"type": "function_call", "id": call_item_id(turn, k),
                      "call_id": call.get("id") or f"call_{turn.hex}_{k}",
                      "name": function.get("name") or "",
                      "arguments": function.get("arguments") or "", "status": "completed"})
    if status == "incomplete" and items:
        items[-1]["status"] = "incomplete"
    return items, status, incomplete


def from_fold(turn: Turn, fold: Fold) -> dict[str, Any]:
    """A finished answer as the Response object, made once per request (the body, the stream's
    last event and the stored copy are the same object)."""
    if turn.answer is None:
        turn.answer = _from_fold(turn, fold)
    return turn.answer


def _from_fold(turn: Turn, fold: Fold) -> dict[str, Any]:
    items, status, incomplete = output_of(turn, fold)
    model = fold.opened.model if fold.opened is not None else None
    if fold.failed is not None:
        return response_object(turn, status="failed", output=items, model=model,
                               usage=usage_json(fold.usage), error=error_json(fold.failed))
    return response_object(turn, status=status, output=items, usage=usage_json(fold.usage),
                           model=model, incomplete=incomplete)


def whole(request: OpenAIRequest, fold: Fold) -> dict[str, Any]:
    return from_fold(turn_of(request), fold)


def kept(gw: GatewayState) -> stored_responses.Keeper:
    """The gateway's stored responses (writes queued off the answer's path, reads that see
    them: `tenancy.stored_responses.Keeper`)."""
    return stored_responses.Keeper(gw.sessionmaker, gw.spawn)


async def keep(ticket: Ticket, fold: Fold) -> None:
    """Store a finished answer for its tenant (unless `store` is false): queued before its
    last byte leaves and written in the background, so a client that saw it complete finds it
    (`Keeper.find` waits for the write). A failed write costs the client nothing but the
    stored copy (logged)."""
    turn = turn_of(ticket.call.request)
    if not turn.store:
        return
    body = from_fold(turn, fold)
    if body["status"] not in ("completed", "incomplete"):
        return
    kept(ticket.gw).keep(
        response_id=turn.response_id, tenant_id=ticket.key.tenant_id, status=body["status"],
        previous_response_id=turn.previous_response_id, body=body,
        input_items=turn.input_items, history=turn.history)


def sse(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class StreamRenderer:
    """One answer's events as the Responses stream: response.created and .in_progress, then
    per output item output_item.added, (content_part.added, output_text.delta ... .done,
    content_part.done) or function_call_arguments.delta ... .done, output_item.done; then
    response.completed or response.incomplete with the whole Response (the same object
    `whole` gives and the store keeps). A failure is an `error` and response.failed. Every
    event carries its sequence_number."""

    def __init__(self, request: OpenAIRequest, prompt_tokens: int) -> None:
        self._turn = turn_of(request)
        self._prompt_tokens = prompt_tokens
        self._fold = Fold(chat=True)
        self._seq = 0
        self._started = False
        self._items: list[dict[str, Any]] = []  # as streamed so far
        self._open: dict[str, Any] | None = None  # the item open now
        self._part: dict[str, Any] | None = None  # its open content part (a message's)
        self._pieces: list[str] = []  # the open part's text so far
        self._text: list[str] = []  # text not folded yet
        self._delta_head = b""  # an output_text.delta event up to its delta, while one is open
        self._messages = 0
        self._calls = 0

    @property
    def fold(self) -> Fold:
        """The answer so far, folded (the relay's, for the cache and `keep`: one fold)."""
        self._fold_text()
        return self._fold

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return sse(kind, data)

    def _snapshot(self, status: str) -> dict[str, Any]:
        return response_object(self._turn, status=status, output=[], usage=None)

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        snapshot = dumps(self._snapshot("in_progress"))  # written once, sent twice
        out = b""
        for kind in ("response.created", "response.in_progress"):
            out += (b"event: " + kind.encode() + b'\ndata: {"type":"' + kind.encode()
                    + b'","response":' + snapshot + b',"sequence_number":'
                    + str(self._seq).encode() + b"}\n\n")
            self._seq += 1
        return out

    def render(self, event: Event) -> bytes:
        if isinstance(event, TextDelta) and event.index == 0:
            logprobs = (event.logprobs or {}).get("content") if self._turn.logprobs else None
            if logprobs:
                self._fold_text()
                self._fold.add(event)
            else:
                self._text.append(event.text)  # folded later, at once (`_fold_text`)
            if not event.text:
                return self._start()
            if self._delta_head and not logprobs:  # the common case, written directly
                self._pieces.append(event.text)
                seq = self._seq
                self._seq += 1
                return (self._delta_head + dumps(event.text)
                        + b',"logprobs":[],"sequence_number":' + str(seq).encode() + b"}\n\n")
            return self._start() + self._content("output_text", event.text, logprobs)
        self._fold_text()
        self._fold.add(event)
        out = self._start()
        if isinstance(event, OtherDelta) and event.index == 0 and isinstance(
                event.fields.get("refusal"), str) and event.fields["refusal"]:
            out += self._content("refusal", event.fields["refusal"], None)
        elif isinstance(event, ToolCallDelta) and event.index == 0:
            out += self._call(event)
        elif isinstance(event, Failed):
            out += self._event("error", code=event.code, message=event.message, param=None)
            items, _, _ = output_of(self._turn, self._fold)
            out += self._event("response.failed", response=response_object(
                self._turn, status="failed", output=items, usage=usage_json(self._fold.usage),
                error=error_json(event)))
        return out

    def _fold_text(self) -> None:
        """The text since the last fold, as one delta (a fold per token costs more than the
        token's event)."""
        if self._text:
            self._fold.add(TextDelta(0, "".join(self._text)))
            self._text = []

    def done(self) -> bytes:
        out = self._start()
        self._fold_text()
        final = from_fold(self._turn, self._fold)
        item_status = "incomplete" if final["status"] == "incomplete" else "completed"
        out += self._close(item_status)
        if not self._items:  # nothing was said: the empty message the Response holds
            out += self._content("output_text", "", None, empty=True)
            out += self._close(item_status)
        kind = "response.incomplete" if final["status"] == "incomplete" else \
            "response.completed"
        return out + self._event(kind, response=final)

    # -- items --

    def _content(self, kind: str, delta: str, logprobs: list[Any] | None, *,
                 empty: bool = False) -> bytes:
        out = b""
        if self._open is None or self._open["type"] != "message":
            out += self._close("completed")
            item_id = message_id(self._turn, self._messages)
            self._messages += 1
            out += self._add({"type": "message", "id": item_id, "status": "in_progress",
                              "role": "assistant", "content": []})
        item = self._open
        assert item is not None
        if self._part is None or self._part["type"] != kind:
            out += self._close_part()
            self._part = _text_content("", []) if kind == "output_text" else {
                "type": "refusal", "refusal": ""}
            self._pieces = []
            item["content"].append(self._part)
            where = {"item_id": item["id"], "output_index": len(self._items) - 1,
                     "content_index": len(item["content"]) - 1}
            out += self._event("response.content_part.added", **where, part=self._part)
            if kind == "output_text":
                head = dumps({"type": "response.output_text.delta", **where})
                self._delta_head = (b"event: response.output_text.delta\ndata: "
                                    + head[:-1] + b',"delta":')
        if empty:
            return out
        where = {"item_id": item["id"], "output_index": len(self._items) - 1,
                 "content_index": len(item["content"]) - 1}
        self._pieces.append(delta)
        if kind == "output_text":
            self._part["logprobs"] += list(logprobs or [])
            return out + self._event("response.output_text.delta", **where, delta=delta,
                                     logprobs=list(logprobs or []))
        return out + self._event("response.refusal.delta", **where, delta=delta)

    def _call(self, event: ToolCallDelta) -> bytes:
        out = b""
        if event.id is not None or self._open is None or self._open["type"] != "function_call":
            out += self._close("completed")
            k = self._calls
            self._calls += 1
            out += self._add({"type": "function_call", "id": call_item_id(self._turn, k),
                              "call_id": event.id or f"call_{self._turn.hex}_{k}",
                              "name": event.name or "", "arguments": "",
                              "status": "in_progress"})
        item = self._open
        assert item is not None
        if not event.arguments:
            return out
        item["arguments"] += event.arguments
        return out + self._event("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=len(self._items) - 1, delta=event.arguments)

    def _add(self, item: dict[str, Any]) -> bytes:
        self._items.append(item)
        self._open = item
        return self._event("response.output_item.added", output_index=len(self._items) - 1,
                           item=item)  # written now, before the item changes

    def _close_part(self) -> bytes:
        part, item = self._part, self._open
        if part is None or item is None:
            return b""
        self._part = None
        self._delta_head = b""
        part["text" if part["type"] == "output_text" else "refusal"] = "".join(self._pieces)
        self._pieces = []
        where = {"item_id": item["id"], "output_index": len(self._items) - 1,
                 "content_index": len(item["content"]) - 1}
        if part["type"] == "output_text":
            out = self._event("response.output_text.done", **where, text=part["text"],
                              logprobs=part["logprobs"])
        else:
            out = self._event("response.refusal.done", **where, refusal=part["refusal"])
        return out + self._event("response.content_part.done", **where, part=part)

    def _close(self, status: str) -> bytes:
        item = self._open
        if item is None:
            return b""
        out = self._close_part()
        if item["type"] == "function_call":
            out += self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=len(self._items) - 1, name=item["name"],
                               arguments=item["arguments"])
        self._open = None
        item["status"] = status
        return out + self._event("response.output_item.done",
                                 output_index=len(self._items) - 1, item=item)


# ---- errors -------------------------------------------------------------------------------

def as_api_error(exc: RequestError, *, prefix: str | None = None) -> APIError:
    param = exc.param
    message = str(exc)
    if prefix is not None:
        param = f"{prefix}.{param}" if param else prefix
        if exc.param:
            message = message.replace(f"'{exc.param}'", f"'{param}'", 1)
    return APIError(400, message, param=param, code=exc.code)


def missing(response_id: str) -> APIError:
    return not_found(f"Response with id '{response_id}' not found.", param="response_id")
