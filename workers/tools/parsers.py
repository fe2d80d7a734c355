"""Tool-call parsers by name, as vLLM's `--tool-call-parser` selects them per model."""

from __future__ import annotations

from typing import Protocol

from workers.tools.hermes import HermesParser, Parsed
from workers.tools.llama3_json import Llama3JsonParser


class ToolParser(Protocol):
    calls: int

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


TOOL_PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def make_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}") from None
