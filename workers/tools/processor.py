"""Per choice, the model's text -> typed deltas: content, and tool calls where tools are on.

Streaming and non-streamed answers go through the same processor; a non-streamed message is
the fold of the deltas (`workers.protocol.render.Fold`), so both carry the same calls and
content.
"""

from __future__ import annotations

import json
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
        """The constrained array as calls; text the model was cut off in is content."""
        try:
            items = json.loads(self._held)
        except ValueError:
            items = None
        if not isinstance(items, list):
            return [TextDelta(self.index, self._held)] if self._held else []
        calls = [parse_call(json.dumps(item)) for item in items]
        if any(c is None for c in calls):
            return [TextDelta(self.index, self._held)]
        return [self._call(c) for c in calls if c is not None]
