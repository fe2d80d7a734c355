"""Native passthrough: a Responses or Messages request sent to an upstream that speaks that API
as it is, and its answer read back into the typed events every deployment answers in.

Why: translated to chat completions, a request loses what chat has no words for (an upstream's
own reasoning, prompt caching, cache_control hints), so an upstream that serves the surface's
own API (`DeploymentConfig.native`) gets the surface's body instead. Everything else in the
request path is unchanged: the surface still parses into the canonical chat request (routing,
admission, the cache key and any fallback that does not speak the API use it), and the answer
comes back as the same `Opened`, text and tool-call deltas, `Finished`, `Usage` and `Failed`
that a chat upstream gives, so the surface renders it, the cache keeps it and the meter bills
the upstream's own counts without knowing it came natively.

The body carried (`Native`) is built by the surface from fields it validated, never copied
from the client: a Responses body has `previous_response_id` expanded into its input items
(stored responses are the gateway's, per tenant) and `store: false`; the model and `stream`
are set per call, the model being the deployment's upstream model. A Messages call also carries
the client's `anthropic-version` and `anthropic-beta` (names the surface checked are tokens),
sent with the deployment's own headers (`Native.upstream_headers`): a beta changes what
Anthropic's API does, so an upstream that speaks it is told which the client asked for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pydantic import PrivateAttr

from gateway.deployments.config import NativeApi
from workers.protocol.events import (
    Event,
    Failed,
    Finished,
    Opened,
    OtherDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from workers.protocol.requests import ChatCompletionRequest, OpenAIRequest
from workers.protocol.wire_json import dumps

PATHS: dict[NativeApi, str] = {"responses": "/responses", "messages": "/messages"}
ANTHROPIC_VERSION = "2023-06-01"  # the `anthropic-version` header Messages upstreams expect
VERSION_HEADER = "anthropic-version"
BETA_HEADER = "anthropic-beta"


@dataclass(frozen=True, slots=True)
class Native:
    """A surface's own request body as the gateway checked and completed it (no model, no
    stream: `upstream_body` sets them per call), and for Messages the client's
    `anthropic-version` (None: the deployment's, `ANTHROPIC_VERSION`) and `anthropic-beta`
    names, as the surface validated them."""

    api: NativeApi
    body: dict[str, Any]
    version: str | None = None
    betas: tuple[str, ...] = ()

    def upstream_body(self, model: str, *, stream: bool) -> bytes:
        body = {**self.body, "model": model, "stream": stream}
        return dumps(body)

    def upstream_headers(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """The deployment's headers for this call (lower-cased names, its auth among them):
        on Messages the client's version in place of the deployment's, and the client's betas
        after any the deployment names itself, each once."""
        if self.api != "messages" or (self.version is None and not self.betas):
            return headers
        out = dict(headers)
        if self.version is not None:
            out[VERSION_HEADER] = self.version
        if self.betas:
            out[BETA_HEADER] = ",".join(merged_betas((out.get(BETA_HEADER, ""), *self.betas)))
        return out


def merged_betas(values: Iterable[str]) -> tuple[str, ...]:
    """The beta names in comma-separated `values`, in order, each once (empty items, as HTTP
    lists allow them, dropped)."""
    names = (name.strip(" \t") for value in values for name in value.split(","))
    return tuple(dict.fromkeys(name for name in names if name))


MakeNative = Callable[[], Native]


class NativeChat(ChatCompletionRequest):
    """A canonical chat request that also carries its surface's native body, or how to make
    it: most requests go to deployments that translate, and the body costs a model dump."""

    _native: Native | MakeNative | None = PrivateAttr(default=None)
    # The API of that body, known without making it: a deployment that does not serve the API
    # (most do not) never pays for the body.
    _native_api: NativeApi | None = PrivateAttr(default=None)
    # What the client asked beside the body that a native upstream is sent and that can
    # change its answer (Messages' version and betas): the response cache keys on it
    # (`cache_variant`) without making the native body. None: nothing asked.
    _variant: dict[str, Any] | None = PrivateAttr(default=None)


def native_api(request: OpenAIRequest) -> NativeApi | None:
    """The API of the native body a surface attached to the request, without making it."""
    return getattr(request, "_native_api", None)


def native_of(request: OpenAIRequest, served: Container[str]) -> Native | None:
    """The native body a surface attached to the canonical request where its API is one of
    `served` (made once, on the first ask), else None."""
    if native_api(request) not in served:
        return None
    native = getattr(request, "_native", None)
    if native is None or isinstance(native, Native):
        return native
    made = native()
    request._native = made  # type: ignore[union-attr]  # a NativeChat: it has a maker
    return made


def with_native(request: NativeChat, api: NativeApi, native: Native | MakeNative
                ) -> NativeChat:
    """The request carrying its surface's native body of `api` (or how to make it)."""
    request._native, request._native_api = native, api
    return request


def with_client_headers(request: NativeChat, version: str | None,
                        betas: tuple[str, ...]) -> NativeChat:
    """The client's Messages `anthropic-version` and `anthropic-beta` (as the surface checked
    them) on the request: sent with its native body (`Native.upstream_headers`), and part of
    its response cache key (`cache_variant`; the betas as a set, their order changing
    nothing), since a beta or a version can change what a native upstream answers. Neither
    given: the request is left as it was, its key too."""
    if version is None and not betas:
        return request
    request._variant = {VERSION_HEADER: version, BETA_HEADER: sorted(betas)}
    return amend_native(request, lambda native: replace(native, version=version, betas=betas))


def cache_variant(request: OpenAIRequest) -> Mapping[str, Any] | None:
    """What the client asked in headers that the request's answer may depend on, for the
    response cache's key (None for all but a Messages request that gave a version or betas:
    chat, completions and Responses keys are as they were)."""
    return getattr(request, "_variant", None)


def amend_native(request: NativeChat, change: Callable[[Native], Native]) -> NativeChat:
    """The request's native body, once made, passed through `change` (nothing without one)."""
    previous = request._native
    if previous is not None:
        request._native = lambda: change(previous if isinstance(previous, Native)
                                         else previous())
    return request


class Reader(Protocol):
    """Reads one answer of a native API into events: a whole JSON body, or its stream's
    events one by one (`finished` once the upstream said the answer is complete)."""

    finished: bool

    def whole(self, obj: dict[str, Any]) -> list[Event]: ...

    def feed(self, obj: dict[str, Any]) -> list[Event]: ...


def reader(api: NativeApi) -> Reader:
    return ResponsesReader() if api == "responses" else MessagesReader()


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


# ---- OpenAI Responses -------------------------------------------------------------------------

INCOMPLETE_REASONS = {"max_output_tokens": "length", "content_filter": "content_filter"}


def responses_usage(value: Any) -> Usage | None:
    """A Response's usage (input_tokens include the cached ones, as chat's prompt_tokens)."""
    if not isinstance(value, dict):
        return None
    cached = _int(_dict(value.get("input_tokens_details")).get("cached_tokens"))
    return Usage(_int(value.get("input_tokens")), _int(value.get("output_tokens")), cached)


@dataclass
class ResponsesReader:
    """OpenAI's Responses answers as events. Function calls are numbered in the order their
    items appear; reasoning items are not surfaced (the Responses surface produces none, and
    their tokens are in the usage billed). A call's or a text's `.done` event gives its whole
    value when no delta did (some servers send no deltas)."""

    finished: bool = False
    _opened: bool = False
    _calls: dict[str, int] = field(default_factory=dict)  # item id -> call index
    _streamed: set[str] = field(default_factory=set)  # items whose deltas came

    def whole(self, obj: dict[str, Any]) -> list[Event]:
        events: list[Event] = [self._opened_of(obj)]
        for item in obj.get("output") or ():
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message":
                for part in item.get("content") or ():
                    events += self._part(_dict(part))
            elif item.get("type") == "function_call":
                events.append(self._call(item, _str(item.get("arguments"))))
        return events + self._end(obj)

    def feed(self, obj: dict[str, Any]) -> list[Event]:
        kind = obj.get("type")
        if kind in ("response.created", "response.in_progress"):
            if self._opened:
                return []
            return [self._opened_of(_dict(obj.get("response")))]
        if kind == "error":  # before anything else: the router may still try elsewhere
            return [_failed(obj)]
        events: list[Event] = [] if self._opened else [self._opened_of({})]
        item_id = _str(obj.get("item_id"))
        if kind == "response.output_text.delta":
            self._streamed.add(item_id)
            logprobs = obj.get("logprobs")
            events.append(TextDelta(0, _str(obj.get("delta")),
                                    {"content": logprobs} if logprobs else None))
        elif kind == "response.output_text.done" and item_id not in self._streamed:
            events.append(TextDelta(0, _str(obj.get("text"))))
        elif kind == "response.refusal.delta":
            self._streamed.add(item_id)
            events.append(OtherDelta(0, {"refusal": _str(obj.get("delta"))}))
        elif kind == "response.refusal.done" and item_id not in self._streamed:
            events.append(OtherDelta(0, {"refusal": _str(obj.get("refusal"))}))
        elif kind == "response.output_item.added":
            item = _dict(obj.get("item"))
            if item.get("type") == "function_call":
                events.append(self._call(item, ""))
        elif kind == "response.function_call_arguments.delta" and item_id in self._calls:
            self._streamed.add(item_id)
            events.append(ToolCallDelta(0, self._calls[item_id], _str(obj.get("delta"))))
        elif kind == "response.function_call_arguments.done" and item_id in self._calls \
                and item_id not in self._streamed:
            events.append(ToolCallDelta(0, self._calls[item_id], _str(obj.get("arguments"))))
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            events += self._end(_dict(obj.get("response")))
        return events

    def _opened_of(self, response: dict[str, Any]) -> Opened:
        self._opened = True
        return Opened(_str(response.get("id")), _int(response.get("created_at"))
                      or int(time.time()), _str(response.get("model")))

    def _part(self, part: dict[str, Any]) -> list[Event]:
        if part.get("type") == "output_text":
            logprobs = part.get("logprobs")
            return [TextDelta(0, _str(part.get("text")),
                              {"content": logprobs} if logprobs else None)]
        if part.get("type") == "refusal":
            return [OtherDelta(0, {"refusal": _str(part.get("refusal"))})]
        return []

    def _call(self, item: dict[str, Any], arguments: str) -> ToolCallDelta:
        k = len(self._calls)
        self._calls[_str(item.get("id")) or f"#{k}"] = k
        return ToolCallDelta(0, k, arguments, id=_str(item.get("call_id")) or None,
                             name=_str(item.get("name")))

    def _end(self, response: dict[str, Any]) -> list[Event]:
        """The answer's end: its finish reason and usage, or its failure."""
        status = response.get("status")
        if status == "failed":
            error = _dict(response.get("error"))
            return [Failed(502, _str(error.get("message")) or "the upstream failed",
                           _str(error.get("code")) or "upstream_error")]
        if status == "incomplete":
            why = _str(_dict(response.get("incomplete_details")).get("reason"))
            reason = INCOMPLETE_REASONS.get(why, "length")
        else:
            reason = "tool_calls" if self._calls else "stop"
        self.finished = True
        events: list[Event] = [Finished(0, reason)]
        usage = responses_usage(response.get("usage"))
        return events if usage is None else [*events, usage]


# ---- Anthropic Messages -----------------------------------------------------------------------

STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop",
                "max_tokens": "length", "model_context_window_exceeded": "length",
                "tool_use": "tool_calls", "refusal": "content_filter"}


def _message_id(value: Any) -> str:
    """The upstream's `msg_...` id without its prefix: the Messages surface names a message
    `msg_<id>` (`surfaces.anthropic.message_id`)."""
    return _str(value).removeprefix("msg_")


@dataclass
class MessagesReader:
    """Anthropic's Messages answers as events. Its `input_tokens` exclude the prompt read from
    or written to its cache, so the prompt billed is their sum (chat's prompt_tokens);
    `output_tokens` in `message_delta` is the running total. Thinking blocks are not surfaced
    (the surface refuses `thinking`)."""

    finished: bool = False
    _opened: bool = False
    _prompt: int = 0
    _cached: int = 0
    _calls: dict[int, int] = field(default_factory=dict)  # content block index -> call index

    def whole(self, obj: dict[str, Any]) -> list[Event]:
        events: list[Event] = [Opened(_message_id(obj.get("id")), int(time.time()),
                                      _str(obj.get("model")))]
        calls = 0
        for block in obj.get("content") or ():
            block = _dict(block)
            if block.get("type") == "text":
                events.append(TextDelta(0, _str(block.get("text"))))
            elif block.get("type") == "tool_use":
                events.append(ToolCallDelta(0, calls, json.dumps(block.get("input") or {}),
                                            id=_str(block.get("id")),
                                            name=_str(block.get("name"))))
                calls += 1
        self._prompt_of(_dict(obj.get("usage")))
        self.finished = True
        output = _int(_dict(obj.get("usage")).get("output_tokens"))
        return [*events, self._finished(obj), Usage(self._prompt, output, self._cached)]

    def feed(self, obj: dict[str, Any]) -> list[Event]:
        kind = obj.get("type")
        if kind == "message_start":
            message = _dict(obj.get("message"))
            self._prompt_of(_dict(message.get("usage")))
            self._opened = True
            return [Opened(_message_id(message.get("id")), int(time.time()),
                           _str(message.get("model")))]
        if kind == "error":
            return [_failed(obj)]
        events: list[Event] = [] if self._opened else [Opened("", int(time.time()), "")]
        self._opened = True
        if kind == "content_block_start":
            block = _dict(obj.get("content_block"))
            if block.get("type") == "text" and block.get("text"):
                events.append(TextDelta(0, _str(block.get("text"))))
            elif block.get("type") == "tool_use":
                k = self._calls[_int(obj.get("index"))] = len(self._calls)
                given = block.get("input")
                events.append(ToolCallDelta(0, k, json.dumps(given) if given else "",
                                            id=_str(block.get("id")),
                                            name=_str(block.get("name"))))
        elif kind == "content_block_delta":
            delta = _dict(obj.get("delta"))
            if delta.get("type") == "text_delta":
                events.append(TextDelta(0, _str(delta.get("text"))))
            elif delta.get("type") == "input_json_delta" and _int(obj.get("index")) in \
                    self._calls:
                events.append(ToolCallDelta(0, self._calls[_int(obj.get("index"))],
                                            _str(delta.get("partial_json"))))
        elif kind == "message_delta":
            usage = _dict(obj.get("usage"))
            if "input_tokens" in usage:  # newer APIs repeat the prompt's counts here
                self._prompt_of(usage)
            events.append(self._finished(_dict(obj.get("delta"))))
            events.append(Usage(self._prompt, _int(usage.get("output_tokens")), self._cached))
        elif kind == "message_stop":
            self.finished = True
        return events

    def _prompt_of(self, usage: dict[str, Any]) -> None:
        self._cached = _int(usage.get("cache_read_input_tokens"))
        self._prompt = (_int(usage.get("input_tokens")) + self._cached
                        + _int(usage.get("cache_creation_input_tokens")))

    @staticmethod
    def _finished(obj: dict[str, Any]) -> Finished:
        reason = _str(obj.get("stop_reason"))
        stop = obj.get("stop_sequence") if reason == "stop_sequence" else None
        return Finished(0, STOP_REASONS.get(reason, "stop"),
                        stop if isinstance(stop, str) else None)


def _failed(obj: dict[str, Any]) -> Failed:
    """An `error` event of either stream: the upstream broke after it had begun."""
    error = _dict(obj.get("error")) or obj
    code = _str(error.get("code")) or _str(error.get("type"))
    return Failed(502, _str(error.get("message")) or "upstream error",
                  code if code and code != "error" else "upstream_error")
