"""OpenAI-shaped calls on an in-process engine, shared by the worker server and the gateway.

Bodies are plain dicts in OpenAI's shape (already type-checked by the gateway, or checked here
by `sampling_params` for the bare worker). Validation and context-length errors raise
`InvalidRequestError` before anything is queued or any byte is streamed, so callers can still
answer with a proper HTTP status.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from workers.async_engine import AsyncLLMEngine
from workers.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from workers.engine.sampling_params import InvalidRequestError
from workers.engine.sequence import RequestMetrics
from workers.llm_engine import PreparedRequest
from workers.openai_protocol import sampling_params

CHAT_ROLES = ("system", "developer", "user", "assistant")


@dataclass
class Usage:
    """Filled in as a request runs; final once the call or stream has ended."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False

    def as_openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class PreparedCall:
    """A validated request: what the engine will run (tokenized once), and its usage so far."""

    chat: bool
    request: PreparedRequest
    model: str  # as the response names it: the base model, or "base:adapter"
    usage: Usage = field(default_factory=Usage)
    metrics: RequestMetrics | None = None  # the engine's timings, from the latest output

    @property
    def max_output_tokens(self) -> int:
        params = self.request.params
        assert params.max_tokens is not None
        return params.max_tokens * params.n


class EmbeddedClient:
    """Turns OpenAI bodies into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    @property
    def context_window(self) -> int:
        return self.engine._require_engine().max_model_len

    def prepare(
        self, body: dict[str, Any], *, chat: bool, cache_salt: str | None = None,
        lora: str | None = None, model: str | None = None,
    ) -> PreparedCall:
        """Tokenize and validate; fixes max_tokens to what will really be generated at most.

        `cache_salt` is the prefix-cache namespace (the gateway passes the tenant); `lora` the
        engine's name of a registered adapter, and `model` what responses call the model."""
        params = sampling_params(body, chat=chat)
        prompt = _prompt(body, chat=chat, tokenizer=self.engine.tokenizer)
        try:
            prepared = self.engine._require_engine().prepare_request(
                prompt, params, cache_salt=cache_salt, lora=lora)
        except InvalidRequestError as exc:
            if chat and exc.param == "prompt":
                exc.param = "messages"
            raise
        call = PreparedCall(chat, prepared, model or self.model_name)
        call.usage.prompt_tokens = len(prepared.prompt_token_ids)
        return call

    async def complete(self, call: PreparedCall, *, request_id: str) -> dict[str, Any]:
        """Run to the end; cancelling the awaiting task aborts the engine request."""
        final: RequestOutput | None = None
        async for final in self.engine.generate(call.request, request_id=request_id):
            _count(call, final)
        assert final is not None
        call.usage.finished = True
        return self._response(final, call, request_id)

    async def open_stream(
        self, call: PreparedCall, *, request_id: str, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """SSE bytes. The first output is awaited here, so engine errors surface before bytes."""
        outputs = self.engine.generate(call.request, request_id=request_id)
        try:
            first = await anext(outputs)
        except BaseException:
            await outputs.aclose()
            raise
        return self._sse(first, outputs, call, request_id, include_usage)

    async def _sse(
        self, first: RequestOutput, rest: AsyncIterator[RequestOutput], call: PreparedCall,
        request_id: str, include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """Deltas per choice; leaving early (client gone) closes `rest`, aborting the request."""
        created = int(time.time())
        kind = "chat.completion.chunk" if call.chat else "text_completion"
        sent: dict[int, int] = {}
        sent_logprobs: dict[int, int] = {}

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {"id": request_id, "object": kind, "created": created,
                                    "model": call.model, "choices": choices}
            if include_usage:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        async def outputs() -> AsyncIterator[RequestOutput]:
            yield first
            async for out in rest:
                yield out

        try:
            async for out in outputs():
                _count(call, out)
                choices = []
                for c in out.outputs:
                    is_first = c.index not in sent
                    delta = c.text[sent.get(c.index, 0):]
                    if not delta and c.finish_reason is None and not is_first:
                        continue
                    sent[c.index] = len(c.text)
                    choice = self._choice_delta(c, delta, is_first, call.chat)
                    if c.logprobs is not None:
                        start = sent_logprobs.get(c.index, 0)
                        choice["logprobs"] = self._logprobs(c.logprobs[start:], call.chat)
                        sent_logprobs[c.index] = len(c.logprobs)
                    choices.append(choice)
                if choices:
                    yield chunk(choices)
            call.usage.finished = True
            if include_usage:
                yield chunk([], call.usage.as_openai())
            yield b"data: [DONE]\n\n"
        finally:
            await rest.aclose()  # type: ignore[attr-defined]

    @staticmethod
    def _choice_delta(
        c: CompletionOutput, delta: str, is_first: bool, chat: bool
    ) -> dict[str, Any]:
        if chat:
            piece: dict[str, Any] = {"content": delta}
            if is_first:
                piece["role"] = "assistant"
            return {"index": c.index, "delta": piece, "logprobs": None,
                    "finish_reason": c.finish_reason}
        return {"index": c.index, "text": delta, "logprobs": None,
                "finish_reason": c.finish_reason}

    def _response(self, out: RequestOutput, call: PreparedCall, request_id: str) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            logprobs = None if c.logprobs is None else self._logprobs(c.logprobs, call.chat)
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                      "logprobs": logprobs}
            if call.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append(choice)
        return {
            "id": request_id, "object": "chat.completion" if call.chat else "text_completion",
            "created": int(time.time()), "model": call.model, "choices": choices,
            "usage": call.usage.as_openai(),
        }

    def _logprobs(self, entries: list[TokenLogprob], chat: bool) -> dict[str, Any]:
        tokenizer = self.engine.tokenizer

        def text(token_id: int) -> str:
            return tokenizer.decode([token_id])

        if chat:
            return {"content": [
                {"token": text(e.token_id), "logprob": e.logprob,
                 "bytes": list(text(e.token_id).encode()),
                 "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
                                  for t, lp in e.top]}
                for e in entries
            ]}
        return {
            "tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
        }


def _count(call: PreparedCall, out: RequestOutput) -> None:
    call.metrics = out.metrics
    usage = call.usage
    usage.prompt_tokens = len(out.prompt_token_ids)
    usage.cached_tokens = out.num_cached_tokens
    usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)


def _prompt(body: dict[str, Any], *, chat: bool, tokenizer: Any) -> str | list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
        rendered = [_message(m, i) for i, m in enumerate(messages)]
        return tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    raise InvalidRequestError("'prompt' must be a string or a list of token ids", param="prompt")


def _message(message: Any, index: int) -> dict[str, str]:
    """One chat message as the template wants it; content parts must be text."""
    param = f"messages.{index}"
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise InvalidRequestError(
            f"{param} must be an object with role one of {', '.join(CHAT_ROLES)}", param=param
        )
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise InvalidRequestError(f"{param}.content: only text parts are supported",
                                          param=f"{param}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise InvalidRequestError(f"{param}.content must be a string", param=f"{param}.content")
    role = "system" if message["role"] == "developer" else message["role"]
    return {"role": role, "content": content}
