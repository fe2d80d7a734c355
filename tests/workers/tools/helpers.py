"""Run a tool-call parser over pieces of text, as the engine feeds it."""

from __future__ import annotations

from typing import Any

from workers.tools.hermes import ParsedCall
from workers.tools.parsers import ToolParser


def run_parser(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    """All the content and calls the parser gives for `pieces`, finish included."""
    content, calls = "", []
    for piece in [*pieces, None]:
        out: Any = parser.feed(piece) if piece is not None else parser.finish()
        content += out.content
        calls += out.calls or []
    return content, calls
