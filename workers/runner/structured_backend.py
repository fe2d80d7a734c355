"""Grammars for structured outputs, through xgrammar: compile once, one matcher per sample.

Why xgrammar (measured in bench/structured_output.py, see docs/engine.md): with SmolLM2's
49,152-token vocabulary its precomputed per-state mask cache fills a bitmask in a few µs per
token on CPU, where llguidance's on-the-fly lexer costs several times that, and it is what
vLLM uses by default. Compiling a schema takes milliseconds, so grammars are compiled when a
request is prepared (a bad schema is a 400 before anything is queued) and cached by their text.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from workers.engine.sampling_params import InvalidRequestError
from workers.engine.structured import StructuredOutputs

CACHE_SIZE = 512  # distinct compiled grammars kept (each holds its per-state mask cache)
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_JSON_OBJECT = '{"type": "object"}'


class StructuredBackend:
    """Compiles constraints against one tokenizer; hands out fresh matchers.

    `compile` may run on any thread (requests are prepared off the step loop); matchers are
    only touched by the step loop."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False
        )
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec` (cached by kind and text); InvalidRequestError when
        the schema, regex or grammar does not compile."""
        key = (spec.kind, spec.text)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        try:
            compiled = self._compile(spec)
        except RuntimeError as exc:  # xgrammar reports every parse/convert error this way
            message = _LOCATION.sub("", str(exc).strip().splitlines()[0])
            raise InvalidRequestError(f"invalid {spec.kind}: {message}",
                                      param=spec.error_param) from exc
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, grammar: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A matcher at the grammar's start. It satisfies `TokenMatcher` and fills its row of
        the bitmask (`fill_next_token_bitmask`); it terminates once a stop token is accepted
        where the grammar is complete, so EOS is only allowed there."""
        return xgr.GrammarMatcher(grammar)

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        # Compact separators (", " and ": "): free whitespace lets weak models loop on newlines.
        if spec.kind == "json":
            return self._compiler.compile_json_schema(spec.text, any_whitespace=False)
        if spec.kind == "json_object":
            return self._compiler.compile_json_schema(_JSON_OBJECT, any_whitespace=False)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            assert spec.choice is not None
            return self._compiler.compile_grammar(choice_grammar(spec.choice))
        return self._compiler.compile_grammar(spec.text)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices`, verbatim (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
