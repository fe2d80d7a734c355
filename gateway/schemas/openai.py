"""OpenAI request bodies, checked strictly: a wrong type is a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=1_000_000)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
ShortText = Annotated[str, Field(max_length=1_000)]


class _Strict(BaseModel):
    # Unknown fields are dropped, never forwarded: a caller cannot smuggle upstream settings.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: Annotated[str, Field(max_length=256)] | None = None


class _Sampling(_Strict):
    model: Annotated[str, Field(min_length=1, max_length=512)]
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: ShortText | Annotated[list[ShortText], Field(max_length=16)] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    # vLLM-style extras our own engine understands.
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    ignore_eos: bool | None = None
    _dumped: dict[str, Any] | None = PrivateAttr(default=None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def upstream_body(self) -> dict[str, Any]:
        """What is sent on: only known fields, only those the caller set.

        Dumped once per request (the cache key and the deployment both need it); each caller
        gets its own top-level dict to add upstream fields to, and must not edit nested ones."""
        if self._dumped is None:
            self._dumped = self.model_dump(exclude_none=True)
        return dict(self._dumped)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=10_000)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        values = [v for v in (self.max_tokens, self.max_completion_tokens) if v is not None]
        return max(values) if values else None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def prompt_chars(self) -> int:
        total = 0
        for m in self.messages:
            total += len(m.content) if isinstance(m.content, str) else sum(
                len(p.text) for p in m.content)
        return total


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | Annotated[
        list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None  # an int, where 0 still returns logprobs

    def prompt_chars(self) -> int:
        if isinstance(self.prompt, str):
            return len(self.prompt)
        if self.prompt and isinstance(self.prompt[0], str):
            return sum(len(p) for p in self.prompt)  # type: ignore[arg-type]
        return len(self.prompt) * 4  # token ids: about four characters each


OpenAIRequest = ChatCompletionRequest | CompletionRequest
