"""Grammars for structured outputs, through llguidance: compile once, one matcher per sample.

Why llguidance rather than xgrammar (measured with SmolLM2's 49,152-token vocabulary in
bench/structured_output.py; docs/engine.md has the table): xgrammar is faster on plain schemas
(a few µs per token against llguidance's tens), but bounded repetition (`maxLength`, large
`minItems`) makes it compile for about a second and fill masks in around a millisecond per
token, while llguidance compiles in a millisecond or two and stays in the tens to low hundreds
of µs. The step loop is shared by every tenant, so the worst case decides.

A compiled grammar is a matcher that never moves (the template); each sample gets a deep copy.

A JSON schema that no finite document satisfies is refused before compiling
(`workers.engine.schema_check`: endless required recursion, which llguidance would only hit
mid-answer, and what it cannot satisfy); llguidance refuses the shallower impossibilities
itself ("Unsatisfiable schema: ..."). Both are `InvalidRequestError`s, a 400 naming the field.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import torch

from workers.engine.sampling_params import InvalidRequestError
from workers.engine.schema_check import unsatisfiable
from workers.engine.structured import StructuredOutputs
from workers.runner.token_mask import bitmask_words

CACHE_SIZE = 512  # distinct compiled grammars kept
# Compact separators, as json.dumps writes them: free whitespace lets weak models loop on it.
JSON_OPTIONS: dict[str, Any] = {"item_separator": ", ", "key_separator": ": ",
                                "whitespace_flexible": False}


class Matcher:
    """One sample's grammar state (a `TokenMatcher`). It terminates once the grammar can take
    nothing more (a complete document), or after a stop token where the grammar allowed one."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def error(self) -> str | None:
        """Why the matcher broke (it refused a token, or hit one of llguidance's limits)."""
        if not self._matcher.is_error():
            return None
        text = self._matcher.get_error().strip()
        return text.splitlines()[0] if text else "the grammar failed"

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of a CPU int32 bitmask."""
        row = bitmask[index]
        assert bitmask.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


class StructuredBackend:
    """Compiles constraints against one tokenizer; hands out fresh matchers.

    `compile` may run on any thread (requests are prepared off the step loop); matchers are
    only touched by the step loop."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The compiled grammar for `spec` (cached by kind and text); InvalidRequestError when
        the schema, regex or grammar does not compile."""
        key = (spec.kind, spec.text)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        try:
            grammar = _grammar(spec)
        except ValueError as exc:  # not JSON, no finite instance, or GBNF that does not convert
            raise _invalid(spec, str(exc)) from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise _invalid(spec, error)
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        # one mask now builds the start's lexer states, which every copy then inherits
        scratch = torch.empty(bitmask_words(self.vocab_size), dtype=torch.int32)
        template.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
        if template.is_error():
            raise _invalid(spec, template.get_error())
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, grammar: llguidance.LLMatcher) -> Matcher:
        """A matcher at the grammar's start (a copy of the untouched template)."""
        return Matcher(grammar.deep_copy())


def _grammar(spec: StructuredOutputs) -> str:
    """llguidance's grammar text for each kind of constraint."""
    if spec.kind == "json":
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema is an object")
        schema = closed_objects(schema)  # what is compiled is what is checked
        reason = unsatisfiable(schema)
        if reason is not None:
            raise ValueError(f"the schema cannot be satisfied: {reason}")
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_OPTIONS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        assert spec.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    assert spec.grammar is not None
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF (converted)


def _invalid(spec: StructuredOutputs, message: str) -> InvalidRequestError:
    first = message.strip().splitlines()[0] if message.strip() else "does not compile"
    return InvalidRequestError(f"invalid {spec.kind}: {first}", param=spec.error_param)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any, *, close: bool = True) -> Any:
    """A copy where objects that list `properties` but say nothing of others get
    `additionalProperties: false`, as OpenAI's strict mode and xgrammar's default do: output
    valid for this is valid for the original, and weak models cannot wander off into keys
    nobody asked for. Parts of an `allOf` stay open (closing each would exclude the others)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, close=False) for sub in out["allOf"]]
    for key in _SCHEMA_ONE:
        if key in out:
            value = out[key]
            out[key] = ([closed_objects(s) for s in value] if isinstance(value, list)
                        else closed_objects(value))
    if close and "properties" in out and "allOf" not in out and not any(
        k in out for k in _OPEN_KEYS
    ):
        out["additionalProperties"] = False
    return out
