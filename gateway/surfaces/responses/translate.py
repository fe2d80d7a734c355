"""A Responses body checked and translated into the canonical chat request.

A deployment whose upstream serves Responses (an `openai` deployment with
`native_apis: [responses]`, a litellm `openai` provider at OpenAI's own endpoint) is sent the
request as a Responses body (`Native`, built here from the validated fields: the conversation
expanded into input items, `store: false`, never `previous_response_id` or `metadata`, as the
gateway keeps the responses) and its answer is read into the same events
(`gateway.deployments.native`); the response id, the stored copy and the rendering stay the
gateway's. Every other deployment gets it translated to chat: input items become chat messages
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
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from gateway.deployments.native import Native, with_native
from gateway.errors import APIError, bad_request, not_found
from gateway.surfaces.responses.schema import (
    INCLUDABLE,
    LOGPROBS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    ImagePart,
    MessageItem,
    RefusalPart,
    ResponsesRequest,
    TextFormat,
    TextPart,
)
from gateway.surfaces.responses.store import kept
from gateway.surfaces.responses.turn import ResponsesChat, Turn
from tenancy import stored_responses
from workers.protocol.requests import ChatCompletionRequest, RequestError, request_error

if TYPE_CHECKING:
    from gateway.state import GatewayState
    from tenancy.context import KeyContext


# What a Responses upstream is sent of a request's own fields, as validated; `input` (the whole
# conversation), `tools` and `store: false` are added (`native_body`), model and stream per call.
NATIVE_FIELDS = frozenset({
    "instructions", "tool_choice", "text", "max_output_tokens", "temperature", "top_p",
    "top_logprobs", "parallel_tool_calls", "user", "safety_identifier", "prompt_cache_key",
    "reasoning", "include", "truncation", "service_tier", "max_tool_calls",
    "prompt_cache_retention"})


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
    with_native(request, "responses", lambda: native_body(body, [*history, *items], tools))
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


def as_api_error(exc: RequestError, *, prefix: str | None = None) -> APIError:
    param = exc.param
    message = str(exc)
    if prefix is not None:
        param = f"{prefix}.{param}" if param else prefix
        if exc.param:
            message = message.replace(f"'{exc.param}'", f"'{param}'", 1)
    return APIError(400, message, param=param, code=exc.code)
