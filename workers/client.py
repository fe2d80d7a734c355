"""OpenAI-shaped calls on an in-process engine, shared by the worker server and the gateway.

Bodies are plain dicts in OpenAI's shape (already type-checked by the gateway, or checked here
by `sampling_params` for the bare worker). Validation and context-length errors raise
`InvalidRequestError` before anything is queued or any byte is streamed, so callers can still
answer with a proper HTTP status.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from workers.async_engine import AsyncLLMEngine
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.output_processor import text_stream, with_text
from workers.engine.outputs import RequestOutput, TokenLogprob
from workers.engine.request import PreparedRequest
from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.engine.sequence import FinishReason, RequestMetrics
from workers.engine.structured import StructuredOutputs
from workers.openai_protocol import sampling_params
from workers.protocol.events import (
    Event,
    Failed,
    Finished,
    Opened,
    TextDelta,
)
from workers.protocol.events import Usage as UsageEvent
from workers.protocol.render import fold
from workers.protocol.usage import GRAMMAR_ERROR, Usage
from workers.tools.choice import ToolPlan, tool_plan
from workers.tools.parsers import make_parser
from workers.tools.processor import ChoiceProcessor
from workers.tools.render import render_chat


class AnswerFailed(Exception):
    """A whole answer broke after it had begun (its events ended in `Failed`)."""

    def __init__(self, failed: Failed) -> None:
        super().__init__(failed.message)
        self.failed = failed


@dataclass
class PreparedCall:
    """A validated request: what the engine will run (tokenized once), and its usage so far."""

    chat: bool
    request: PreparedRequest
    model: str  # as the response names it: the base model, or "base:adapter"
    tools: ToolPlan = field(default_factory=lambda: ToolPlan("none"))
    usage: Usage = field(default_factory=Usage)
    metrics: RequestMetrics | None = None  # the engine's timings, from the latest output
    priority: int = 0  # within its tenant: lower runs first

    def schedule_for(self, tenant: str | None, *, weight: float = 1.0, priority: int = 0) -> None:
        """Whose fair share of the engine this call draws on (the gateway's tenant)."""
        self.request = dataclasses.replace(self.request, tenant=tenant, weight=weight)
        self.priority = priority

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
        lora: str | None = None, model: str | None = None, tenant: str | None = None,
        weight: float = 1.0, priority: int = 0,
    ) -> PreparedCall:
        """Tokenize and validate; fixes max_tokens to what will really be generated at most.

        `cache_salt` is the prefix-cache namespace (the gateway passes the tenant); `lora` the
        engine's name of a registered adapter, and `model` what responses call the model."""
        params = sampling_params(body, chat=chat)
        params.output_kind = "delta"  # the output processor takes only what is new,
        params.detokenize = False  # and detokenizes it, stop strings included
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
        call.schedule_for(tenant, weight=weight, priority=priority)
        call.usage.prompt_tokens = len(prepared.prompt_token_ids)
        return call

    async def events(self, call: PreparedCall, *, request_id: str) -> AsyncIterator[Event]:
        """The answer as events: `Opened` at the engine's first output (the request is then
        running, not stuck), deltas per choice, `Finished`, and `Usage` last.

        Engine errors (overload, a dead engine) raise before the first event. A choice that
        broke midway (its grammar refused a token: `FinishReason.ERROR`) ends the answer
        with `Failed` (500, `grammar_error`) and no `Usage`: an answer with a cut document is
        not passed off as finished. Leaving early (closing this) aborts the engine request."""
        outputs = self.engine.generate(call.request, request_id=request_id,
                                       priority=call.priority)
        processor = OutputEvents(call, self, request_id)
        try:
            async for out in outputs:
                for event in processor.process(out):
                    yield event
                    if isinstance(event, Failed):
                        return
                if processor.done:
                    break  # a stop string ended the last choice: leaving aborts the request
            call.usage.finished = True
            usage = call.usage
            yield UsageEvent(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
            _count_work(call)

    async def complete(self, call: PreparedCall, *, request_id: str) -> dict[str, Any]:
        """The whole response: the fold of `events`; `AnswerFailed` if they ended failed."""
        whole = await fold(self.events(call, request_id=request_id), chat=call.chat)
        if whole.failed is not None:
            raise AnswerFailed(whole.failed)
        return whole.response()

    def logprobs(self, entries: list[TokenLogprob], chat: bool) -> dict[str, Any]:
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


@dataclass
class _ChoiceState:
    tools: ChoiceProcessor
    text: IncrementalDetokenizer
    done: bool = False


class OutputEvents:
    """Engine outputs (token deltas) -> events, outside the engine step: each choice's text,
    stop strings and kept logprobs from the engine's output processor (`with_text`), then
    tool-call parsing and OpenAI's logprob shape; usage counted as tokens arrive. A choice
    that meets a stop string ends here; its sample is stopped in the engine (or the whole
    request is, once every choice has ended)."""

    def __init__(self, call: PreparedCall, client: EmbeddedClient, request_id: str) -> None:
        self.call = call
        self.client = client
        self.request_id = request_id
        self._choices: dict[int, _ChoiceState] = {}
        self._opened = False

    @property
    def done(self) -> bool:
        """Every choice has ended (the engine request may still be live: close it)."""
        n = self.call.request.params.n
        return len(self._choices) == n and all(c.done for c in self._choices.values())

    def process(self, out: RequestOutput) -> list[Event]:
        call = self.call
        events: list[Event] = []
        if not self._opened:
            self._opened = True
            events.append(Opened(self.request_id, int(time.time()), call.model))
        call.metrics = out.metrics
        usage = call.usage
        usage.prompt_tokens = len(out.prompt_token_ids)
        usage.cached_tokens = out.num_cached_tokens
        for c in out.outputs:
            state = self._state(c.index)
            if state.done:
                continue  # stopped here; the engine may not have heard yet
            shown, stopped = with_text(state.text, c)
            usage.completion_tokens += len(shown.token_ids)
            if c.finish_reason == FinishReason.ERROR and not stopped:
                state.done = True
                events.append(Failed(500, f"request {self.request_id}: choice {c.index} broke "
                                     "off: its output no longer followed the requested format "
                                     "(a server-side structured-output error); retry, or "
                                     "simplify the schema", GRAMMAR_ERROR))
                return events
            deltas: list[Event] = list(state.tools.feed(shown.text))
            if c.logprobs:
                logprobs = self.client.logprobs(shown.logprobs or [], call.chat)
                if deltas and isinstance(deltas[0], TextDelta):
                    deltas[0] = TextDelta(c.index, deltas[0].text, logprobs)
                else:
                    deltas.insert(0, TextDelta(c.index, "", logprobs))
            events += deltas
            if shown.finish_reason is not None:
                state.done = True
                last, reason = state.tools.finish(shown.finish_reason)
                matched = shown.stop_reason if isinstance(shown.stop_reason, str) else None
                events += [*last, Finished(c.index, reason,
                                           matched if reason == "stop" else None)]
                if stopped and not self.done and c.finish_reason is None:
                    self.client.engine.stop_sample(self.request_id, c.index,
                                                   state.text.stop_reason)
        return events

    def _state(self, index: int) -> _ChoiceState:
        state = self._choices.get(index)
        if state is None:
            request = self.call.request
            state = self._choices[index] = _ChoiceState(
                ChoiceProcessor(index, self.call.tools, self.client.tool_call_parser),
                text_stream(self.client.engine.tokenizer, request.prompt_token_ids,
                            request.params))
        return state


FLOOR_LOGPROB = -9999.0  # what OpenAI reports for a token the model all but rules out


def finite(logprob: float) -> float:
    """A logprob JSON can carry: NaN and -inf (a masked or impossible token) would be
    written as bare `NaN` / `-Infinity`, which is not JSON."""
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


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


def prompt_token_ids(body: dict[str, Any], *, chat: bool, tokenizer: Any) -> list[int]:
    """The token ids `prepare` runs for this body, without an engine: a gateway with the
    same tokenizer names the same prefix-cache blocks (prefix-aware routing)."""
    tools = tool_plan(body) if chat else ToolPlan("none")
    prompt = _prompt(body, chat=chat, tokenizer=tokenizer, tools=tools)
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    return list(prompt)


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
