"""What a request's `tools` and `tool_choice` ask of the engine.

- `none` (or no tools): plain text, no parsing.
- `auto`: the model decides; calls are parsed out of its text (`workers.tools.hermes`).
- `required`: the output is constrained to a JSON array of at least one call
  (`[{"name": ..., "arguments": {...}}]`, at most one when `parallel_tool_calls` is false), each
  call's arguments valid for its function's parameter schema.
- a named function: the output is constrained to that function's arguments.
The constraint is an ordinary JSON schema handed to structured outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.engine.sampling_params import InvalidRequestError

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] = field(default_factory=list)
    named: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow, or None (none/auto)."""
        if self.mode == "named":
            return _parameters(self._function(self.named))
        if self.mode != "required":
            return None
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": f["name"]},
                                 "arguments": _parameters(f)}}
                 for f in (t["function"] for t in self.tools)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def tool_plan(body: dict[str, Any]) -> ToolPlan:
    """Read and check `tools`, `tool_choice` and `parallel_tool_calls` (InvalidRequestError)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean",
                                  param="parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return ToolPlan("none")
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise InvalidRequestError("'tools' must be a list of {type: function, function: "
                                  "{name, parameters}}", param="tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
        return ToolPlan(choice, tools, parallel=parallel is not False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError("'tool_choice' must be none, auto, required or "
                                  "{type: function, function: {name}} naming one of 'tools'",
                                  param="tool_choice")
    return ToolPlan("named", tools, named=name, parallel=parallel is not False)


def _is_tool(tool: Any) -> bool:
    if not (isinstance(tool, dict) and tool.get("type") == "function"):
        return False
    function = tool.get("function")
    return (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("parameters", {}), dict))


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or ANY_OBJECT
