"""Hermes-style tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) parsed
out of a model's text as it streams, like vLLM's `--tool-call-parser hermes`.

Text outside the tags is content. A tail that could still become `<tool_call>` is held back
until it cannot, so no tag fragment ever reaches the client as content. A block whose JSON is
not a call is passed on as content, tags and all: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    """What one piece of text yielded: content to show and calls completed."""

    content: str = ""
    calls: list[ParsedCall] | None = None


class HermesParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self.calls = 0

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        calls: list[ParsedCall] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._inside = False
                self._take(block, out, calls)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(OPEN):]
                self._inside = True
                continue
            keep = _partial_tag_length(self._buffer)
            out.content += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        out.calls = calls or None
        return out

    def finish(self) -> Parsed:
        """The end of the text: an unclosed block is a call if its JSON is one."""
        out = Parsed()
        calls: list[ParsedCall] = []
        if self._inside:
            self._take(self._buffer, out, calls, closed=False)
        else:
            out.content = self._buffer
        self._buffer, self._inside = "", False
        out.calls = calls or None
        return out

    def _take(self, block: str, out: Parsed, calls: list[ParsedCall], *,
              closed: bool = True) -> None:
        call = parse_call(block)
        if call is None:
            out.content += OPEN + block + (CLOSE if closed else "")
            return
        calls.append(call)
        self.calls += 1


def parse_call(block: str) -> ParsedCall | None:
    """`{"name": str, "arguments": object}` (or `parameters`, as some models write) -> call."""
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ParsedCall(data["name"], arguments)
    return ParsedCall(data["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag_length(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `<tool_call>`."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
