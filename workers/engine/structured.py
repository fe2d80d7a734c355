"""What a request's output must look like (structured outputs), as plain data.

The engine core only carries this spec and the opaque per-sample matcher; compiling grammars
and computing token masks live in `workers.runner.structured_backend` (no torch here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from workers.engine.sampling_params import InvalidRequestError

MAX_CHOICES = 1024
MAX_SPEC_CHARS = 200_000  # a schema, regex or grammar: bounds compile time and cache memory


class TokenMatcher(Protocol):
    """One sample's grammar state, advanced with each token the sample keeps."""

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def error(self) -> str | None:
        """Why the grammar broke (after `accept_token` refused a token), else None."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted (speculative verification reads ahead)."""
        ...


@dataclass
class StructuredOutputs:
    """Exactly one constraint. `json` is a JSON schema (a dict, or its text); `json_object`
    asks for any JSON object; `regex`, `choice` (one of these strings, verbatim) and `grammar`
    (llguidance's Lark dialect, or GBNF) constrain plain text.

    `param` names the request field this came from, for error messages (e.g.
    `response_format.json_schema.schema`); None names the engine's own field."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar")
                      if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise InvalidRequestError(
                "structured outputs need exactly one of json, json_object, regex, choice, "
                f"grammar (got {', '.join(set_fields) or 'none'})", param=self.param)
        self._validate()

    def _validate(self) -> None:
        param = self.error_param
        if self.json is not None and not isinstance(self.json, dict | str):
            raise InvalidRequestError("a JSON schema must be an object or its text", param=param)
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise InvalidRequestError("choice must be a non-empty list of strings",
                                          param=param)
            if len(self.choice) > MAX_CHOICES or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise InvalidRequestError(
                    f"choice must hold 1 to {MAX_CHOICES} non-empty strings", param=param)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string", param=param)
        try:
            text = self.text
        except (TypeError, ValueError) as exc:  # a dict that is not JSON
            raise InvalidRequestError(f"the JSON schema is not JSON: {exc}", param=param) from exc
        if len(text) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"the {self.kind} is longer than {MAX_SPEC_CHARS} "
                                      "characters", param=param)

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def text(self) -> str:
        """The constraint as one string: with `kind`, the key of the compiled-grammar cache."""
        if isinstance(self.json, dict):
            # key order kept: properties are generated in the order the schema lists them
            return json.dumps(self.json, separators=(",", ":"), ensure_ascii=False)
        if self.choice is not None:
            return json.dumps(self.choice, ensure_ascii=False)
        return self.json or self.regex or self.grammar or ""

    @property
    def error_param(self) -> str:
        """The field an error about this constraint names."""
        return self.param or f"structured.{self.kind}"
