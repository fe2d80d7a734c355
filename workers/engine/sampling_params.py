"""Per-request sampling settings, named after OpenAI's and vLLM's fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # structured.py imports InvalidRequestError from here
    from workers.engine.structured import StructuredOutputs

MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


class InvalidRequestError(ValueError):
    """A request the engine refuses before it queues anything (maps to HTTP 400)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # added to the logits, OpenAI's -100..100
    structured: StructuredOutputs | None = None  # a grammar the output must follow
    # "delta": each output holds only what is new since the last one (a streaming caller's
    # shape: no cumulative copies per step); "cumulative": everything so far (LLM.generate).
    output_kind: str = "cumulative"
    # False: outputs carry token ids only, and stop strings are the caller's to match (an
    # output processor outside the engine step detokenizes, and stops the sample with
    # `stop_sample`); EOS, stop token ids and max_tokens still end it here.
    detokenize: bool = True
    # Proposed tokens per step under the engine's speculative decoding: None is the engine's
    # own k; a request may lower it (0: off for this request), never raise it.
    speculative_tokens: int | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self._validate()
        if self.output_kind not in ("cumulative", "delta"):
            raise InvalidRequestError("output_kind must be 'cumulative' or 'delta'")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.structured is not None:
            from workers.engine.structured import StructuredOutputs

            if not isinstance(self.structured, StructuredOutputs):
                raise InvalidRequestError("structured must be a StructuredOutputs")

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (self.n <= 128, "n must be at most 128"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must not exceed max_tokens",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
                f"logprobs must be in [0, {self.MAX_LOGPROBS}]",
            ),
            (len(self.stop) <= 16, "at most 16 stop strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (
                self.speculative_tokens is None or (
                    isinstance(self.speculative_tokens, int)
                    and not isinstance(self.speculative_tokens, bool)
                    and 0 <= self.speculative_tokens <= 16),
                "speculative_tokens must be an integer in [0, 16]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _checked_logit_bias(bias: object) -> dict[int, float]:
    """Token id -> bias in [-100, 100]; ids are checked against the vocabulary later."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS_ENTRIES} entries",
                                  param="logit_bias")
    checked = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequestError(f"logit_bias key {token!r} is not a token id",
                                      param="logit_bias")
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequestError(
                f"logit_bias values must be numbers in [-100, 100], not {value!r}",
                param="logit_bias")
        checked[token] = float(value)
    return checked
