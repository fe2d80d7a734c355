"""The mock upstream's answers on OpenAI's Responses (``POST /v1/responses``) and Anthropic's
Messages (``POST /v1/messages``) APIs, in their own shapes, whole or as their typed
server-sent events; :class:`~bench.common.mock_upstream.MockUpstream` serves them beside chat.

Both give the mock's fixed reply, cut at ``max_output_tokens`` / ``max_tokens`` (one "token" a
word), or, when the request offers tools (and ``tool_choice`` is not ``none``), one call of its
first tool with :data:`TOOL_ARGUMENTS`. Usage counts the prompt's text as the mock does for
chat (one token per 4 characters), so a test can tell the upstream's numbers from a gateway's
own estimate.
"""

from __future__ import annotations

import json
import time
from typing import Any

TOOL_ARGUMENTS = {"city": "Paris"}
NATIVE_PATHS = ("/v1/responses", "/v1/messages")


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _text(value: Any) -> str:
    """The text of a content value: a string, or the text of a list of parts or blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return ""
    out = []
    for part in value:
        if isinstance(part, dict):
            for key in ("text", "output", "content", "arguments"):
                if key in part:
                    out.append(_text(part[key]) if key == "content" else str(part[key]))
    return " ".join(out)


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The prompt of a Responses or Messages request (instructions or system, then turns)."""
    if path == "/v1/responses":
        given = body.get("input")
        items = [{"content": given}] if isinstance(given, str) else given or []
        head = body.get("instructions") or ""
        return " ".join([head, *(_text([i]) for i in items if isinstance(i, dict))]).strip()
    system = _text(body.get("system"))
    turns = [_text(m.get("content")) for m in body.get("messages") or [] if isinstance(m, dict)]
    return " ".join([system, *turns]).strip()


def tool_to_call(path: str, body: dict[str, Any]) -> str | None:
    """The name of the tool the mock calls: the request's first, unless it asks for none."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or not tools or not isinstance(tools[0], dict):
        return None
    if choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    name = tools[0].get("name")
    return name if isinstance(name, str) else None


def sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {_json(data)}\n\n".encode()


def answer(path: str, body: dict[str, Any], pieces: list[str], finish: str,
           prompt_tokens: int, ident: int) -> tuple[dict[str, Any] | None, list[bytes] | None]:
    """(the whole answer, None) or (None, its events) for a request on `path`."""
    tool = tool_to_call(path, body)
    if path == "/v1/responses":
        return _responses(body, pieces, finish, prompt_tokens, ident, tool)
    return _messages(body, pieces, finish, prompt_tokens, ident, tool)


# ---- Responses --------------------------------------------------------------------------------

def _responses(body: dict[str, Any], pieces: list[str], finish: str, prompt_tokens: int,
               ident: int, tool: str | None
               ) -> tuple[dict[str, Any] | None, list[bytes] | None]:
    rid = f"resp_mock{ident}"
    arguments = _json(TOOL_ARGUMENTS)
    if tool is not None:
        item = {"type": "function_call", "id": f"fc_mock{ident}", "call_id": f"call_mock{ident}",
                "name": tool, "arguments": arguments, "status": "completed"}
        output_tokens, status, incomplete = 5, "completed", None
    else:
        item = {"type": "message", "id": f"msg_mock{ident}", "role": "assistant",
                "status": "completed", "content": [{"type": "output_text", "text": "".join(
                    pieces), "annotations": [], "logprobs": []}]}
        output_tokens = len(pieces)
        status, incomplete = ("incomplete", {"reason": "max_output_tokens"}) \
            if finish == "length" else ("completed", None)
    usage = {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt_tokens + output_tokens}
    head = {"id": rid, "object": "response", "created_at": int(time.time()),
            "model": body["model"], "store": body.get("store", True), "error": None}
    final = {**head, "status": status, "incomplete_details": incomplete, "output": [item],
             "usage": usage}
    if body.get("stream") is not True:
        return final, None
    seq = iter(range(10_000))

    def event(kind: str, **fields: Any) -> bytes:
        return sse(kind, {"type": kind, **fields, "sequence_number": next(seq)})

    started = {**head, "status": "in_progress", "output": [], "usage": None}
    events = [event("response.created", response=started),
              event("response.in_progress", response=started)]
    where = {"item_id": item["id"], "output_index": 0}
    if tool is not None:
        events.append(event("response.output_item.added", output_index=0,
                             item={**item, "arguments": "", "status": "in_progress"}))
        half = len(arguments) // 2
        for piece in (arguments[:half], arguments[half:]):
            events.append(event("response.function_call_arguments.delta", **where,
                                delta=piece))
        events.append(event("response.function_call_arguments.done", **where,
                            arguments=arguments))
    else:
        events.append(event("response.output_item.added", output_index=0,
                            item={**item, "content": [], "status": "in_progress"}))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(event("response.content_part.added", **where, content_index=0,
                            part=part))
        events += [event("response.output_text.delta", **where, content_index=0, delta=p,
                         logprobs=[]) for p in pieces]
        events.append(event("response.output_text.done", **where, content_index=0,
                            text="".join(pieces), logprobs=[]))
        events.append(event("response.content_part.done", **where, content_index=0,
                            part=item["content"][0]))
    events.append(event("response.output_item.done", output_index=0, item=item))
    kind = "response.incomplete" if status == "incomplete" else "response.completed"
    return None, [*events, event(kind, response=final)]


# ---- Messages ---------------------------------------------------------------------------------

def _messages(body: dict[str, Any], pieces: list[str], finish: str, prompt_tokens: int,
              ident: int, tool: str | None
              ) -> tuple[dict[str, Any] | None, list[bytes] | None]:
    if tool is not None:
        block: dict[str, Any] = {"type": "tool_use", "id": f"toolu_mock{ident}", "name": tool,
                                 "input": TOOL_ARGUMENTS}
        output_tokens, reason = 5, "tool_use"
    else:
        block = {"type": "text", "text": "".join(pieces)}
        output_tokens = len(pieces)
        reason = "max_tokens" if finish == "length" else "end_turn"
    message = {"id": f"msg_mock{ident}", "type": "message", "role": "assistant",
               "model": body["model"], "content": [block], "stop_reason": reason,
               "stop_sequence": None,
               "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens}}
    if body.get("stream") is not True:
        return message, None
    start = {**message, "content": [], "stop_reason": None,
             "usage": {"input_tokens": prompt_tokens, "output_tokens": 1}}
    events = [sse("message_start", {"type": "message_start", "message": start})]
    if tool is not None:
        opened = {**block, "input": {}}
        arguments = _json(TOOL_ARGUMENTS)
        half = len(arguments) // 2
        deltas = [{"type": "input_json_delta", "partial_json": p}
                  for p in (arguments[:half], arguments[half:])]
    else:
        opened = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": p} for p in pieces]
    events.append(sse("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": opened}))
    events.append(sse("ping", {"type": "ping"}))
    events += [sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": d}) for d in deltas]
    events.append(sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
    events.append(sse("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": reason, "stop_sequence": None},
        "usage": {"output_tokens": output_tokens}}))
    return None, [*events, sse("message_stop", {"type": "message_stop"})]


def error_body(message: str, type_: str) -> bytes:
    """An error in Anthropic's shape."""
    return _json({"type": "error", "error": {"type": type_, "message": message}}).encode()
