"""The Responses stream: one answer's events rendered, as they come, as typed server-sent
events, ending with the same Response object the body gives (`objects`)."""

from __future__ import annotations

from typing import Any

from gateway.surfaces.responses.objects import (
    call_item_id,
    error_json,
    from_fold,
    message_id,
    output_of,
    response_object,
    text_content,
    usage_json,
)
from gateway.surfaces.responses.turn import turn_of
from workers.protocol.events import Event, Failed, OtherDelta, TextDelta, ToolCallDelta
from workers.protocol.render import Fold, sse_event
from workers.protocol.requests import OpenAIRequest
from workers.protocol.wire_json import dumps


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
        return sse_event(kind, data)

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
            self._part = text_content("", []) if kind == "output_text" else {
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
