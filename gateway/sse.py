"""Completions as server-sent events and back: a cached answer replays as a live stream, and a
live stream is assembled into the one response the cache keeps."""

from __future__ import annotations

import json
import re
from typing import Any

DONE = b"data: [DONE]\n\n"
_PIECES = re.compile(r"\s*\S+|\s+")  # words with their leading space: about one token each


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def replay(response: dict[str, Any], *, chat: bool, include_usage: bool) -> list[bytes]:
    """The events of a stream that carries exactly `response` (a non-streamed completion)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": response.get("id"), "object": kind, "created": response.get("created"),
            "model": response.get("model")}
    extra = {"usage": None} if include_usage else {}
    choices = response.get("choices") or []
    events: list[bytes] = []
    if chat:
        events.append(event({**head, "choices": [
            {"index": c.get("index", i), "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None} for i, c in enumerate(choices)], **extra}))
    for i, choice in enumerate(choices):
        index = choice.get("index", i)
        text = _text(choice, chat) or ""
        for piece in _PIECES.findall(text):
            part = ({"index": index, "delta": {"content": piece}, "logprobs": None,
                     "finish_reason": None} if chat else
                    {"index": index, "text": piece, "logprobs": None, "finish_reason": None})
            events.append(event({**head, "choices": [part], **extra}))
        calls = (choice.get("message") or {}).get("tool_calls") or [] if chat else []
        for k, call in enumerate(calls):  # one delta per call: id, name and all its arguments
            delta = {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                     "function": call["function"]}]}
            events.append(event({**head, "choices": [
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
                **extra}))
        last = ({"index": index, "delta": {}, "logprobs": None,
                 "finish_reason": choice.get("finish_reason")} if chat else
                {"index": index, "text": "", "logprobs": None,
                 "finish_reason": choice.get("finish_reason")})
        events.append(event({**head, "choices": [last], **extra}))
    if include_usage and response.get("usage") is not None:
        events.append(event({**head, "choices": [], "usage": response["usage"]}))
    events.append(DONE)
    return events


def _text(choice: dict[str, Any], chat: bool) -> str | None:
    if chat:
        message = choice.get("message") or {}
        content = message.get("content")
        return content if isinstance(content, str) else None
    text = choice.get("text")
    return text if isinstance(text, str) else None


class StreamAssembler:
    """Collects a stream's events into the non-streamed response they add up to.

    `result()` is None unless the stream ended properly ([DONE], every choice finished, no
    error event): a cut or failed stream must never be cached."""

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self._head: dict[str, Any] | None = None
        self._texts: dict[int, list[str]] = {}
        self._calls: dict[int, dict[int, dict[str, Any]]] = {}
        self._finish: dict[int, str | None] = {}
        self._usage: dict[str, Any] | None = None
        self._done = False
        self._broken = False

    def feed(self, chunk: bytes) -> None:
        for line in chunk.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self._done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                self._broken = True
                continue
            self._take(obj)

    def _take(self, obj: Any) -> None:
        if not isinstance(obj, dict) or "error" in obj:
            self._broken = True
            return
        if self._head is None:
            self._head = {k: obj.get(k) for k in ("id", "created", "model")}
        if isinstance(obj.get("usage"), dict):
            self._usage = obj["usage"]
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = int(choice.get("index", 0))
            delta = choice.get("delta") or {}
            piece = delta.get("content") if self.chat else choice.get("text")
            if isinstance(piece, str):
                self._texts.setdefault(index, []).append(piece)
            if self.chat:
                self._take_delta(index, delta)
            if choice.get("finish_reason") is not None:
                self._finish[index] = choice["finish_reason"]
            self._texts.setdefault(index, [])

    def _take_delta(self, index: int, delta: Any) -> None:
        """Tool-call pieces by call index; anything a replay could not give back (refusals,
        audio, ...) marks the stream as not worth keeping."""
        if not isinstance(delta, dict):
            self._broken = True
            return
        if any(v is not None for k, v in delta.items() if k not in ("role", "content",
                                                                  "tool_calls")):
            self._broken = True
        for piece in delta.get("tool_calls") or []:
            if not isinstance(piece, dict) or not isinstance(piece.get("index"), int):
                self._broken = True
                continue
            call = self._calls.setdefault(index, {}).setdefault(
                piece["index"], {"id": None, "type": "function",
                                 "function": {"name": None, "arguments": ""}})
            call["id"] = piece.get("id") or call["id"]
            function = piece.get("function") or {}
            call["function"]["name"] = function.get("name") or call["function"]["name"]
            call["function"]["arguments"] += function.get("arguments") or ""

    def result(self) -> dict[str, Any] | None:
        if not self._done or self._broken or self._head is None or not self._texts:
            return None
        if any(self._finish.get(i) is None for i in self._texts):
            return None
        choices = []
        for index in sorted(self._texts):
            text = "".join(self._texts[index])
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                calls = [self._calls[index][k] for k in sorted(self._calls.get(index, {}))]
                if calls:
                    message["tool_calls"] = calls
                    message["content"] = text or None
                choices.append({"index": index, "logprobs": None, "message": message,
                                "finish_reason": self._finish[index]})
            else:
                choices.append({"index": index, "text": text, "logprobs": None,
                                "finish_reason": self._finish[index]})
        obj = "chat.completion" if self.chat else "text_completion"
        response = {**self._head, "object": obj, "choices": choices}
        if self._usage is not None:
            response["usage"] = self._usage
        return response
