"""The input processor: a prompt and its sampling params -> a `PreparedRequest`.

Tokenizing, every check that can refuse a request, and compiling its grammar happen here,
before anything is queued and off the step loop (the async engine calls it on the event
loop's side), so a bad request costs the engine nothing and is refused with a proper 400.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from workers.engine.request import PreparedRequest
from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.engine.speculative import SpeculativeConfig, check_request_tokens


class InputProcessor:
    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: list[int],
                 max_model_len: int, max_num_seqs: int,
                 speculative: SpeculativeConfig | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.speculative = speculative
        self._grammars: Any = None  # StructuredBackend, built for the first structured request
        self._grammars_lock = threading.Lock()

    def prepare(self, prompt: str | list[int], params: SamplingParams, *,
                cache_salt: str | None = None, lora: str | None = None) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from any thread)."""
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        check_request_tokens(params.speculative_tokens, self.speculative)
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_length(len(token_ids), params)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                f"(size {self.vocab_size})", param="logit_bias")
        # compiled here, so a bad schema is refused before anything is queued
        grammar = self.grammars().compile(params.structured) if params.structured else None
        if params.max_tokens != max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        return PreparedRequest(text, token_ids, params, cache_salt, lora, grammar)

    def grammars(self) -> Any:
        """The structured-outputs backend (a `StructuredBackend`), built on first use: it
        reads the whole vocabulary once (under a second) and imports llguidance."""
        with self._grammars_lock:
            if self._grammars is None:
                from workers.runner.structured_backend import StructuredBackend

                self._grammars = StructuredBackend(self.tokenizer, self.vocab_size,
                                                   self.eos_token_ids)
            return self._grammars

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
            if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty")
        return text, token_ids

    def _check_length(self, prompt_len: int, params: SamplingParams) -> int:
        """The effective max_tokens; refuse what can never fit the context window."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; "
                f"the prompt has {prompt_len}", param="prompt", code="context_length_exceeded"
            )
        if params.max_tokens is None:
            return limit - prompt_len
        if prompt_len + params.max_tokens > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{prompt_len + params.max_tokens} ({prompt_len} in the prompt, "
                f"{params.max_tokens} to generate)", param="max_tokens",
                code="context_length_exceeded",
            )
        return params.max_tokens
