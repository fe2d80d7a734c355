"""OpenAI-shaped calls on an in-process engine, shared by the worker server and the gateway.

Bodies are plain dicts in OpenAI's shape (already type-checked by the gateway, or checked here
by `sampling_params` for the bare worker). Validation and context-length errors raise
`InvalidRequestError` before anything is queued or any byte is streamed, so callers can still
answer with a proper HTTP status.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from workers.async_engine import AsyncLLMEngine
from workers.engine.outputs import RequestOutput, TokenLogprob
from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.engine.sequence import RequestMetrics
from workers.engine.structured import StructuredOutputs
from workers.events import Delta
from workers.llm_engine import PreparedRequest
from workers.openai_protocol import sampling_params
from workers.tools.choice import ToolPlan, tool_plan
from workers.tools.parsers import make_parser
from workers.tools.processor import ChoiceProcessor, fold, sse_delta
from workers.tools.render import render_chat


@dataclass
class Usage:
    """Filled in as a request runs; final once the call or stream has ended."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    # Of the prompt, what the deployment had computed when the request ended (engines report
    # it; None where nobody knows): what an answer cut short before its first token costs.
    computed_prompt_tokens: int | None = None

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
    tools: ToolPlan = field(default_factory=lambda: ToolPlan("none"))
    usage: Usage = field(default_factory=Usage)
    metrics: RequestMetrics | None = None  # the engine's timings, from the latest output

    @property
    def max_output_tokens(self) -> int:
        params = self.request.params
        assert params.max_tokens is not None
        return params.max_tokens * params.n


class EmbeddedClient:
    """Turns OpenAI bodies into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, *,
                 tool_call_parser: str = "hermes") -> None:
        make_parser(tool_call_parser)  # an unknown name fails here, not on the first call
        self.engine = engine
        self.model_name = model_name
        self.tool_call_parser = tool_call_parser

    @property
    def context_window(self) -> int:
        return self.engine._require_engine().max_model_len

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: its vocabulary entry's length (a
        byte-level entry has one character per byte, never fewer than it decodes to)."""
        vocab = self.engine.tokenizer.get_vocab()
        return max(1, max((len(piece) for piece in vocab), default=1))

    def prepare(
        self, body: dict[str, Any], *, chat: bool, cache_salt: str | None = None,
        lora: str | None = None, model: str | None = None,
    ) -> PreparedCall:
        """Tokenize and validate; fixes max_tokens to what will really be generated at most.

        `cache_salt` is the prefix-cache namespace (the gateway passes the tenant); `lora` the
        engine's name of a registered adapter, and `model` what responses call the model."""
        params = sampling_params(body, chat=chat)
        tools = tool_plan(body) if chat else ToolPlan("none")
        _constrain_tool_calls(params, tools)
        prompt = _prompt(body, chat=chat, tokenizer=self.engine.tokenizer, tools=tools)
        try:
            prepared = self.engine._require_engine().prepare_request(
                prompt, params, cache_salt=cache_salt, lora=lora)
        except InvalidRequestError as exc:
            if chat and exc.param == "prompt":
                exc.param = "messages"
            raise
        call = PreparedCall(chat, prepared, model or self.model_name, tools)
        call.usage.prompt_tokens = len(prepared.prompt_token_ids)
        return call

    async def complete(self, call: PreparedCall, *, request_id: str,
                       on_first_output: Callable[[], None] | None = None) -> dict[str, Any]:
        """Run to the end; cancelling the awaiting task aborts the engine request.

        `on_first_output` is called once the engine has produced something: the request is
        then running, not stuck (the gateway's routing deadline stops there)."""
        final: RequestOutput | None = None
        try:
            async for final in self.engine.generate(call.request, request_id=request_id):
                if on_first_output is not None:
                    on_first_output()
                    on_first_output = None
                _count(call, final)
        finally:
            _count_work(call)
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
            _count_work(call)
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

        processors: dict[int, ChoiceProcessor] = {}
        try:
            async for out in outputs():
                _count(call, out)
                choices = []
                for c in out.outputs:
                    is_first = c.index not in sent
                    processor = processors.get(c.index)
                    if processor is None:
                        processor = processors[c.index] = ChoiceProcessor(
                            c.index, call.tools, self.tool_call_parser)
                    deltas = processor.feed(c.text[sent.get(c.index, 0):])
                    sent[c.index] = len(c.text)
                    finish_reason = None
                    if c.finish_reason is not None:
                        last, finish_reason = processor.finish(c.finish_reason)
                        deltas += last
                    logprobs = None
                    if c.logprobs is not None and len(c.logprobs) > sent_logprobs.get(c.index, 0):
                        start = sent_logprobs.get(c.index, 0)
                        logprobs = self._logprobs(c.logprobs[start:], call.chat)
                        sent_logprobs[c.index] = len(c.logprobs)
                    choices += self._choice_deltas(c.index, deltas, is_first, call.chat,
                                                   finish_reason, logprobs)
                if choices:
                    yield chunk(choices)
            call.usage.finished = True
            if include_usage:
                yield chunk([], call.usage.as_openai())
            yield b"data: [DONE]\n\n"
        finally:
            await rest.aclose()  # type: ignore[attr-defined]
            _count_work(call)

    @staticmethod
    def _choice_deltas(index: int, deltas: list[Delta], is_first: bool, chat: bool,
                       finish_reason: str | None, logprobs: dict[str, Any] | None
                       ) -> list[dict[str, Any]]:
        """One stream choice per delta (OpenAI sends content and each tool-call piece in
        chunks of their own); the first carries the role, the last the finish reason."""
        pieces: list[dict[str, Any]] = [sse_delta(d) for d in deltas]
        if not pieces and (is_first or finish_reason is not None or logprobs is not None):
            pieces = [{"content": ""} if is_first or logprobs is not None else {}]
        out = []
        for i, piece in enumerate(pieces):
            if chat:
                if is_first and i == 0:
                    piece = {"role": "assistant", **piece}
                    if "tool_calls" in piece:
                        piece["content"] = None
                choice: dict[str, Any] = {"index": index, "delta": piece, "logprobs": None,
                                          "finish_reason": None}
            else:
                choice = {"index": index, "text": piece.get("content", ""), "logprobs": None,
                          "finish_reason": None}
            out.append(choice)
        if out:
            out[0]["logprobs"] = logprobs
            out[-1]["finish_reason"] = finish_reason
        return out

    def _response(self, out: RequestOutput, call: PreparedCall, request_id: str) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            logprobs = None if c.logprobs is None else self._logprobs(c.logprobs, call.chat)
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                      "logprobs": logprobs}
            if call.chat:
                processor = ChoiceProcessor(c.index, call.tools, self.tool_call_parser)
                message = fold(processor.feed(c.text))
                last, choice["finish_reason"] = processor.finish(c.finish_reason)
                choice["message"] = fold(last, into=message).as_openai()
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
                {"token": text(e.token_id), "logprob": finite(e.logprob),
                 "bytes": list(text(e.token_id).encode()),
                 "top_logprobs": [{"token": text(t), "logprob": finite(lp),
                                   "bytes": list(text(t).encode())} for t, lp in e.top]}
                for e in entries
            ]}
        return {
            "tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [finite(e.logprob) for e in entries],
            "top_logprobs": [{text(t): finite(lp) for t, lp in e.top} for e in entries],
        }


FLOOR_LOGPROB = -9999.0  # what OpenAI reports for a token the model all but rules out


def finite(logprob: float) -> float:
    """A logprob JSON can carry: NaN and -inf (a masked or impossible token) would be
    written as bare `NaN` / `-Infinity`, which is not JSON."""
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


def _count(call: PreparedCall, out: RequestOutput) -> None:
    call.metrics = out.metrics
    usage = call.usage
    usage.prompt_tokens = len(out.prompt_token_ids)
    usage.cached_tokens = out.num_cached_tokens
    usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)


def _count_work(call: PreparedCall) -> None:
    """The prompt work the engine did, however the request ended (see Usage)."""
    progress = call.request.progress
    call.usage.computed_prompt_tokens = progress.num_computed_tokens
    if not call.usage.completion_tokens:
        call.usage.cached_tokens = progress.num_cached_tokens


def _constrain_tool_calls(params: SamplingParams, tools: ToolPlan) -> None:
    """`required` and a named function constrain decoding to valid calls (a JSON schema)."""
    schema = tools.schema()
    if schema is None:
        return
    if params.structured is not None:
        raise InvalidRequestError("tool_choice 'required' or a named function cannot be "
                                  "combined with response_format or structured outputs",
                                  param="tool_choice")
    params.structured = StructuredOutputs(json=schema, param="tools")


def _prompt(body: dict[str, Any], *, chat: bool, tokenizer: Any,
            tools: ToolPlan) -> str | list[int]:
    if chat:
        # `none` still shows the tools (as vLLM does): the conversation may refer to them,
        # and the prompt keeps the same prefix (and prefix-cache hits) across tool choices.
        return render_chat(tokenizer, body.get("messages"), tools=tools.tools or None)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    raise InvalidRequestError("'prompt' must be a string or a list of token ids", param="prompt")
