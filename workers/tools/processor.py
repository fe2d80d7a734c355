"""Per choice, the model's text -> typed deltas: content, and tool calls where tools are on.

Streaming and non-streamed answers go through the same processor; a non-streamed message is
the fold of the deltas (`workers.protocol.render.Fold`), so both carry the same calls and
content.
"""

from __future__ import annotations

import json
import re
import uuid

from workers.protocol.events import Delta, TextDelta, ToolCallDelta
from workers.tools.choice import ToolPlan
from workers.tools.hermes import Parsed, ParsedCall, parse_call
from workers.tools.parsers import make_parser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceProcessor:
    """Feeds one choice's new text; says what to send and how the choice finished."""

    def __init__(self, index: int, plan: ToolPlan, parser: str = "hermes") -> None:
        self.index = index
        self.plan = plan
        self.calls = 0
        self._parser = make_parser(parser) if plan.mode == "auto" else None
        self._held = ""  # required: the whole JSON array, parsed at the end

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        mode = self.plan.mode
        if mode == "none":
            return [TextDelta(self.index, text)]
        if mode == "named":
            if self.calls == 0:
                self.calls = 1
                return [ToolCallDelta(self.index, 0, text, id=call_id(), name=self.plan.named)]
            return [ToolCallDelta(self.index, 0, text)]
        if mode == "required":
            self._held += text
            return []
        assert self._parser is not None
        return self._emit(self._parser.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        """The last deltas, and the finish reason to report (`tool_calls` where calls were
        made and the model stopped by itself; a forced function ends with `stop`, as OpenAI's
        does)."""
        deltas: list[Delta] = []
        mode = self.plan.mode
        if mode == "auto":
            assert self._parser is not None
            deltas = self._emit(self._parser.finish())
        elif mode == "required":
            deltas = self._required()
        elif mode == "named" and self.calls == 0:
            self.calls = 1
            deltas = [ToolCallDelta(self.index, 0, "", id=call_id(), name=self.plan.named)]
        if self.calls and finish_reason == "stop" and mode != "named":
            finish_reason = "tool_calls"
        return deltas, finish_reason

    def _emit(self, parsed: Parsed) -> list[Delta]:
        deltas: list[Delta] = []
        if parsed.content and not (self.calls and not parsed.content.strip()):
            deltas.append(TextDelta(self.index, parsed.content))
        for call in parsed.calls or ():
            deltas.append(self._call(call))
        return deltas

    def _call(self, call: ParsedCall) -> ToolCallDelta:
        delta = ToolCallDelta(self.index, self.calls, call.arguments, id=call_id(),
                              name=call.name)
        self.calls += 1
        return delta

    def _required(self) -> list[Delta]:
        """The constrained array as calls. An array cut short (max_tokens) gives its whole
        calls and the one it was cut in, with the arguments written so far: tool JSON is
        never content, and the finish reason says `length`."""
        calls = [self._call(call) for call in held_calls(
            self._held, [t["function"]["name"] for t in self.plan.tools])]
        return list(calls)


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)("?)')
_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def held_calls(held: str, names: list[str]) -> list[ParsedCall]:
    """The calls of a `required` array (`[{"name": ..., "arguments": {...}}, ...]`), whole
    or cut short: each whole item, then the item the text ends in, its name completed where
    the text began it (names are constants of the grammar) and its arguments as written."""
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    start = held.find("[")
    if start < 0:
        return calls
    pos = start + 1
    while pos < len(held):
        while pos < len(held) and held[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(held) or held[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(held, pos)
        except ValueError:
            cut = _cut_call(held[pos:], names)
            if cut is not None:
                calls.append(cut)
            break
        call = parse_call(json.dumps(item))
        if call is not None:
            calls.append(call)
    return calls


def _cut_call(text: str, names: list[str]) -> ParsedCall | None:
    """The item the text was cut in: its name (completed from the tools where it was cut
    mid-name and only one tool fits) and its arguments so far."""
    match = _NAME.match(text)
    if match is None:
        return None
    name = json.loads(f'"{match.group(1)}"') if match.group(2) else match.group(1)
    if not match.group(2):
        fits = [n for n in names if n.startswith(name)]
        if len(fits) != 1:
            return None
        name = fits[0]
    rest = text[match.end():]
    arguments = _ARGUMENTS.match(rest)
    return ParsedCall(name, rest[arguments.end():] if arguments else "")
