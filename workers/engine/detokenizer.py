"""Incremental, UTF-8 safe detokenizing with stop strings matched across token boundaries.

Text is released only when it is final: never half a multibyte character (the tokenizer
shows those as U+FFFD until the rest arrives) and never a tail that could still grow into a
stop string, so a stop string never leaks into a stream.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = stop or []
        self._include_stop = include_stop_str_in_output
        # Decoding a few prompt tokens first keeps leading spaces right for every tokenizer.
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._decoded = ""
        self._taken = 0  # characters of `text` already handed on by `take`
        self.text = ""
        self.stop_reason: str | None = None

    def append(self, token_id: int) -> bool:
        """Add one generated token; True if a stop string ended the output."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return False  # an incomplete character: wait for the next token
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._extend(delta)

    def flush(self) -> None:
        """Release everything held back; the output ended for another reason (length, EOS)."""
        if self.stop_reason is not None:
            return
        if self._read_offset < len(self._ids):  # an unfinished character at the very end
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            self._decoded += self._decode(self._ids[self._prefix_offset :])[len(prefix) :]
            self._read_offset = len(self._ids)
        self.text = self._decoded

    def take(self) -> str:
        """The text released since the last `take`: what a delta output carries."""
        new = self.text[self._taken :]
        self._taken = max(self._taken, len(self.text))
        return new

    def _extend(self, delta: str) -> bool:
        start = max(len(self._decoded) - self._longest_stop + 1, 0)
        self._decoded += delta
        for stop in self._stop:
            at = self._decoded.find(stop, start)
            if at != -1:
                end = at + len(stop) if self._include_stop else at
                self._decoded = self._decoded[:end]
                self.text = self._decoded
                self.stop_reason = stop
                return True
        self.text = self._decoded[: len(self._decoded) - self._held_back()]
        return False

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self._decoded)), held, -1):
                if self._decoded.endswith(stop[:size]):
                    held = size
                    break
        return held

    @property
    def _longest_stop(self) -> int:
        return max((len(s) for s in self._stop), default=1)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
