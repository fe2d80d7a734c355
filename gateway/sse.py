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
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get(
                "text")
            if isinstance(piece, str):
                self._texts.setdefault(index, []).append(piece)
            if choice.get("finish_reason") is not None:
                self._finish[index] = choice["finish_reason"]
            self._texts.setdefault(index, [])

    def result(self) -> dict[str, Any] | None:
        if not self._done or self._broken or self._head is None or not self._texts:
            return None
        if any(self._finish.get(i) is None for i in self._texts):
            return None
        choices = []
        for index in sorted(self._texts):
            text = "".join(self._texts[index])
            if self.chat:
                choices.append({"index": index, "logprobs": None,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": self._finish[index]})
            else:
                choices.append({"index": index, "text": text, "logprobs": None,
                                "finish_reason": self._finish[index]})
        obj = "chat.completion" if self.chat else "text_completion"
        response = {**self._head, "object": obj, "choices": choices}
        if self._usage is not None:
            response["usage"] = self._usage
        return response
