"""Llama 3.x JSON tool calls: the answer is one or more `{"name": ..., "parameters": {...}}`
objects (optionally after `<|python_tag|>`, several separated by `;`), like vLLM's
`--tool-call-parser llama3_json`.

An answer that starts like a call is held until it ends, then parsed whole; one that does not
is content from its first character. Text that does not parse as calls is passed on as
content, unchanged.
"""

from __future__ import annotations

import json

from workers.tools.hermes import Parsed, ParsedCall, parse_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    def __init__(self) -> None:
        self._held = ""
        self._mode: str | None = None  # None (undecided), "calls" or "content"
        self.calls = 0

    def feed(self, text: str) -> Parsed:
        if self._mode == "content":
            return Parsed(content=text)
        self._held += text
        head = self._held.lstrip()
        if not head:
            return Parsed()
        if head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
            self._mode = "calls" if len(head) >= len(PYTHON_TAG) or head[0] == "{" else None
            return Parsed()
        self._mode = "content"
        held, self._held = self._held, ""
        return Parsed(content=held)

    def finish(self) -> Parsed:
        held, self._held = self._held, ""
        if self._mode == "content" or not held:
            return Parsed(content=held)
        calls = _calls(held.strip().removeprefix(PYTHON_TAG))
        if calls is None:
            return Parsed(content=held)
        self.calls += len(calls)
        return Parsed(calls=calls)


def _calls(text: str) -> list[ParsedCall] | None:
    """`{...}; {...}` -> calls, or None if any piece is not a call."""
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    at = 0
    while at < len(text):
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            break
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = parse_call(json.dumps(obj))
        if call is None:
            return None
        calls.append(call)
    return calls or None
