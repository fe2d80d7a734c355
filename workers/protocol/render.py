"""Events to OpenAI JSON and SSE, and back: the one place either shape is written or read.

`StreamRenderer` writes a live (or replayed) answer as chunks; `Fold` adds events up to the
non-streamed response; `events_of_response` and `events_of_chunk` read an upstream's JSON or
SSE chunk into events, once. A response folded from the events of a response is that response
(for the fields OpenAI defines, and the extras carried by `Opened`/`OtherDelta`/`Usage`).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.protocol.events import (
    Event,
    Failed,
    Finished,
    Opened,
    OtherDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
    aclose,
)
from workers.protocol.wire_json import dumps

DONE = b"data: [DONE]\n\n"
_PIECES = re.compile(r"\s*\S+|\s+")  # words with their leading space
_HEAD = ("id", "object", "created", "model", "choices", "usage")
_MESSAGE_TYPED = ("role", "content", "tool_calls")


def data(obj: dict[str, Any]) -> bytes:
    """One SSE event."""
    return b"data: " + dumps(obj) + b"\n\n"


def sse_event(kind: str, obj: dict[str, Any]) -> bytes:
    """One SSE event that names its type (`event:`), as Anthropic's and the Responses API's
    streams do."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


def usage_json(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = dict(usage.extra or {})
    details = dict(body.get("prompt_tokens_details") or {})
    details["cached_tokens"] = usage.cached_tokens
    body.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                total_tokens=usage.prompt_tokens + usage.completion_tokens,
                prompt_tokens_details=details)
    return body


def error_json(failed: Failed) -> dict[str, Any]:
    return {"error": {"message": failed.message, "type": "server_error", "param": None,
                      "code": failed.code}}


class StreamRenderer:
    """One answer's events as OpenAI chunks (chat or text completion).

    A chat choice's first chunk carries the role. With `include_usage`, every chunk has
    `usage: null` and the usage comes last in a chunk of its own, as OpenAI sends it."""

    def __init__(self, *, chat: bool, include_usage: bool) -> None:
        self.chat = chat
        self.include_usage = include_usage
        self._head: dict[str, Any] = {"id": None, "object": self._object, "created": None,
                                      "model": None}
        self._prefix = b""  # the head as written before every chunk's choices
        self._suffix = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self._started: set[int] = set()

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def done(self) -> bytes:
        """What ends a stream that did not fail."""
        return DONE

    def render(self, event: Event) -> bytes:
        """The bytes for `event` (b"" for one the client is not sent)."""
        if isinstance(event, Opened):
            self._head = {"id": event.id, "object": self._object, "created": event.created,
                          "model": event.model, **(event.extra or {})}
            self._prefix = b""
            return b""
        if isinstance(event, Usage):
            if not self.include_usage:
                return b""
            return data({**self._head, "choices": [], "usage": usage_json(event)})
        if isinstance(event, Failed):
            return data(error_json(event))
        return self._chunk(self._choice(event))

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        """`{head, "choices": [choice], "usage": null}`, with the head written once."""
        if not self._prefix:
            self._prefix = b"data: " + dumps(self._head)[:-1] + b',"choices":['
        return self._prefix + dumps(choice) + self._suffix

    def _choice(self, event: TextDelta | ToolCallDelta | OtherDelta | Finished
                ) -> dict[str, Any]:
        logprobs = event.logprobs if isinstance(event, TextDelta) else None
        reason = event.reason if isinstance(event, Finished) else None
        if not self.chat:
            text = event.text if isinstance(event, TextDelta) else ""
            return {"index": event.index, "text": text, "logprobs": logprobs,
                    "finish_reason": reason}
        delta: dict[str, Any]
        if isinstance(event, TextDelta):
            delta = {"content": event.text}
        elif isinstance(event, ToolCallDelta):
            delta = {"tool_calls": [tool_call_piece(event)]}
        elif isinstance(event, OtherDelta):
            delta = dict(event.fields)
        else:
            delta = {}
        if event.index not in self._started:
            self._started.add(event.index)
            if isinstance(event, Finished):
                delta = {"content": ""}
            delta = {"role": "assistant", **delta}
            if "tool_calls" in delta:
                delta["content"] = None
        return {"index": event.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": reason}


def tool_call_piece(event: ToolCallDelta) -> dict[str, Any]:
    """A tool-call delta as OpenAI streams it: id, type and name only in the first."""
    if event.id is None:
        return {"index": event.call_index, "function": {"arguments": event.arguments}}
    return {"index": event.call_index, "id": event.id, "type": "function",
            "function": {"name": event.name, "arguments": event.arguments}}


async def sse(events: AsyncIterator[Event], *, chat: bool, include_usage: bool
              ) -> AsyncIterator[bytes]:
    """A whole stream: the events' chunks, then [DONE] (not after a failure, which ends it).
    Leaving early closes `events` (the deployment then aborts its work)."""
    renderer = StreamRenderer(chat=chat, include_usage=include_usage)
    try:
        async for event in events:
            raw = renderer.render(event)
            if raw:
                yield raw
            if isinstance(event, Failed):
                return
        yield DONE
    finally:
        await aclose(events)


class Renderer(Protocol):
    """One answer's events as a surface's stream (OpenAI's, Anthropic's, ...). One that folds
    the answer for itself may lend it as `fold` (a `Fold` of every event rendered so far), so
    the relay does not fold it twice (`gateway.answers`)."""

    def render(self, event: Event) -> bytes: ...

    def done(self) -> bytes: ...


def replay(events: Iterable[Event], renderer: Renderer) -> list[bytes]:
    """A stored answer as a live stream: text in word-sized pieces (about a token each),
    so a client sees a cache hit stream as it would a live answer."""
    out: list[bytes] = []
    for event in events:
        if isinstance(event, TextDelta) and event.logprobs is None and event.text:
            pieces = [TextDelta(event.index, p) for p in _PIECES.findall(event.text)]
        else:
            pieces = [event]
        out += [raw for piece in pieces if (raw := renderer.render(piece))]
    return [*out, renderer.done()]


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    other: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, Any] | None = None
    finished: bool = False
    reason: str | None = None
    stop_sequence: str | None = None


class Fold:
    """Events added up to the non-streamed response they stand for."""

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self.opened: Opened | None = None
        self.usage: Usage | None = None
        self.failed: Failed | None = None
        self._choices: dict[int, _Choice] = {}

    def add(self, event: Event) -> None:
        if isinstance(event, Opened):
            self.opened = self.opened or event
            return
        if isinstance(event, Usage):
            self.usage = event
            return
        if isinstance(event, Failed):
            self.failed = event
            return
        choice = self._choices.setdefault(event.index, _Choice())
        if isinstance(event, TextDelta):
            choice.text.append(event.text)
            if event.logprobs is not None:
                choice.logprobs = merge_logprobs(choice.logprobs, event.logprobs)
        elif isinstance(event, ToolCallDelta):
            call = choice.calls.setdefault(event.call_index, {
                "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}})
            call["function"]["arguments"] += event.arguments
        elif isinstance(event, OtherDelta):
            for key, value in event.fields.items():
                choice.other[key] = _joined(choice.other.get(key), value)
        else:
            choice.finished, choice.reason = True, event.reason
            choice.stop_sequence = event.stop_sequence

    def stop_sequence(self, index: int = 0) -> str | None:
        """The stop string that ended a choice, where the deployment said (not in OpenAI's
        response shape)."""
        choice = self._choices.get(index)
        return None if choice is None else choice.stop_sequence

    @property
    def complete(self) -> bool:
        """Begun, every choice finished, nothing failed: an answer worth keeping."""
        return (self.opened is not None and self.failed is None and bool(self._choices)
                and all(c.finished for c in self._choices.values()))

    def response(self) -> dict[str, Any]:
        opened = self.opened or Opened("", 0, "")
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            text = "".join(choice.text)
            out: dict[str, Any] = {"index": index}
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text or (
                    None if choice.calls or "refusal" in choice.other else "")}
                if choice.calls:
                    message["tool_calls"] = [choice.calls[k] for k in sorted(choice.calls)]
                message.update(choice.other)
                out["message"] = message
            else:
                out["text"] = text
            out.update(logprobs=choice.logprobs, finish_reason=choice.reason)
            choices.append(out)
        response: dict[str, Any] = {
            "id": opened.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": opened.created, "model": opened.model, **(opened.extra or {}),
            "choices": choices}
        if self.usage is not None:
            response["usage"] = usage_json(self.usage)
        return response


async def fold(events: AsyncIterator[Event], *, chat: bool = False, into: Fold | None = None
               ) -> Fold:
    """Read `events` to the end (closing them however it ends) into their fold (`into`, or a
    new one)."""
    folded = into if into is not None else Fold(chat=chat)
    try:
        async for event in events:
            folded.add(event)
    finally:
        await aclose(events)
    return folded


def merge_logprobs(into: dict[str, Any] | None, piece: dict[str, Any]) -> dict[str, Any]:
    """Logprobs of consecutive pieces as one: the lists (content, tokens, ...) joined."""
    if into is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in piece.items()}
    for key, value in piece.items():
        if isinstance(value, list) and isinstance(into.get(key), list):
            into[key].extend(value)
        elif value is not None or key not in into:
            into[key] = list(value) if isinstance(value, list) else value
    return into


def _joined(old: Any, new: Any) -> Any:
    if isinstance(old, str) and isinstance(new, str):
        return old + new
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    return new


# ---- reading upstreams ---------------------------------------------------------------------

def opened_of(obj: dict[str, Any]) -> Opened:
    """The head of an upstream's response or first chunk."""
    extra = {k: v for k, v in obj.items() if k not in _HEAD and v is not None}
    return Opened(str(obj.get("id") or ""), _int(obj.get("created")), str(obj.get("model") or ""),
                  extra or None)


def usage_of(value: Any) -> Usage | None:
    """An upstream's OpenAI `usage` object (None when it is not one)."""
    if not isinstance(value, dict):
        return None
    details = value.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    extra = {k: v for k, v in value.items()
             if k not in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return Usage(_int(value.get("prompt_tokens")), _int(value.get("completion_tokens")),
                 _int(cached), extra or None)


def events_of_response(obj: dict[str, Any], *, chat: bool) -> list[Event]:
    """A non-streamed response as the events whose fold it is."""
    events: list[Event] = [opened_of(obj)]
    for index, choice, logprobs in _choices(obj):
        if chat:
            message = choice.get("message") or {}
            content = message.get("content")
            events.append(TextDelta(index, content if isinstance(content, str) else "",
                                    logprobs))
            for k, call in enumerate(message.get("tool_calls") or []):
                function = call.get("function") or {}
                events.append(ToolCallDelta(index, k, function.get("arguments") or "",
                                            id=call.get("id") or "", name=function.get("name")))
            other = {k: v for k, v in message.items() if k not in _MESSAGE_TYPED
                     and v is not None}
            if other:
                events.append(OtherDelta(index, other))
        else:
            text = choice.get("text")
            events.append(TextDelta(index, text if isinstance(text, str) else "", logprobs))
        events.append(Finished(index, choice.get("finish_reason")))
    usage = usage_of(obj.get("usage"))
    if usage is not None:
        events.append(usage)
    return events


def events_of_chunk(obj: dict[str, Any], *, chat: bool) -> list[Event]:
    """One streamed chunk's events (its head aside: `opened_of` the first chunk)."""
    if "error" in obj:
        error = obj["error"] if isinstance(obj["error"], dict) else {}
        return [Failed(502, str(error.get("message") or "upstream error"),
                       str(error.get("code") or "upstream_error"))]
    events: list[Event] = []
    for index, choice, logprobs in _choices(obj):
        if chat:
            events += _delta_events(index, choice.get("delta") or {}, logprobs)
        elif isinstance(choice.get("text"), str) or logprobs is not None:
            events.append(TextDelta(index, choice.get("text") or "", logprobs))
        if choice.get("finish_reason") is not None:
            events.append(Finished(index, choice["finish_reason"]))
    usage = usage_of(obj.get("usage"))
    if usage is not None:
        events.append(usage)
    return events


def _choices(obj: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any], Any]]:
    """Each choice object with its index and logprobs (anything else in the list skipped)."""
    for position, choice in enumerate(obj.get("choices") or []):
        if isinstance(choice, dict):
            yield _int(choice.get("index", position)), choice, choice.get("logprobs")


def _delta_events(index: int, delta: dict[str, Any], logprobs: Any) -> list[Event]:
    events: list[Event] = []
    content = delta.get("content")
    if isinstance(content, str) or logprobs is not None or (
            delta.get("role") is not None and not delta.get("tool_calls")):
        events.append(TextDelta(index, content if isinstance(content, str) else "", logprobs))
    for piece in delta.get("tool_calls") or []:
        if not isinstance(piece, dict):
            continue
        function = piece.get("function") or {}
        events.append(ToolCallDelta(index, _int(piece.get("index")),
                                    function.get("arguments") or "", id=piece.get("id"),
                                    name=function.get("name")))
    other = {k: v for k, v in delta.items() if k not in _MESSAGE_TYPED and v is not None}
    if other:
        events.append(OtherDelta(index, other))
    return events


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
