"""What a deployment's answer is made of, as typed events (one choice each, by `index`).

The engine's output processor turns sampled text into these; OpenAI JSON and SSE are rendered
from them, and a non-streamed answer is their fold (`workers.tools.processor.fold`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A tool call's first delta carries its id and name; later ones only argument text."""

    index: int  # the choice
    call_index: int  # the call within the choice
    arguments: str
    id: str | None = None
    name: str | None = None


Delta = TextDelta | ToolCallDelta
