"""Native passthrough, piece by piece: the Responses and Messages readers (whole answers and
streams into the typed events), the bodies the surfaces attach (validated fields only), which
deployments speak which API (config and litellm providers), and an HTTP upstream's native
answers that fail, are cut, or are left by the client."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError
from starlette.datastructures import Headers

from gateway.deployments.base import Call, UpstreamFailure
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.external import LiteLLMDeployment
from gateway.deployments.http import HttpDeployment
from gateway.deployments.http_pool import HttpPool
from gateway.deployments.native import (
    MessagesReader,
    Native,
    ResponsesReader,
    native_api,
    native_of,
)
from gateway.errors import APIError
from gateway.surfaces import anthropic, responses
from tests.gateway.support import loopback_upstream
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
from workers.protocol.requests import ChatCompletionRequest

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:litellm"),
              pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning")]


def fed(reader: ResponsesReader | MessagesReader, events: list[dict[str, Any]]) -> list[Event]:
    out: list[Event] = []
    for event in events:
        out += reader.feed(event)
    return out


def without_time(events: list[Event]) -> list[Event]:
    return [Opened(e.id, 0, e.model) if isinstance(e, Opened) else e for e in events]


# ---- the Responses reader ---------------------------------------------------------------------

RESPONSE = {"id": "resp_up", "created_at": 7, "model": "gpt-up", "status": "in_progress"}
USAGE = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4},
         "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 2}}


def test_a_responses_stream_becomes_the_chat_events():
    piece = {"token": "Hi", "logprob": -0.1, "top_logprobs": []}
    reader = ResponsesReader()
    events = fed(reader, [
        {"type": "response.created", "response": RESPONSE},
        {"type": "response.in_progress", "response": RESPONSE},
        {"type": "response.output_item.added", "item": {"type": "reasoning", "id": "rs_1"}},
        {"type": "response.output_item.added", "item": {"type": "message", "id": "msg_1"}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "Hi",
         "logprobs": [piece]},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "!",
         "logprobs": []},
        {"type": "response.output_text.done", "item_id": "msg_1", "text": "Hi!"},
        {"type": "response.refusal.delta", "item_id": "msg_1", "delta": "no"},
        {"type": "response.output_item.added", "item": {
            "type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "f"}},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": "{}"},
        {"type": "response.function_call_arguments.done", "item_id": "fc_1",
         "arguments": "{}"},
        # a server that sends no deltas: the .done event gives the whole arguments
        {"type": "response.output_item.added", "item": {
            "type": "function_call", "id": "fc_2", "call_id": "call_b", "name": "g"}},
        {"type": "response.function_call_arguments.done", "item_id": "fc_2",
         "arguments": '{"x":1}'},
    ])
    assert not reader.finished
    events += reader.feed({"type": "response.completed",
                           "response": {**RESPONSE, "status": "completed", "usage": USAGE}})
    assert reader.finished
    assert events == [
        Opened("resp_up", 7, "gpt-up"),
        TextDelta(0, "Hi", {"content": [piece]}), TextDelta(0, "!"),
        OtherDelta(0, {"refusal": "no"}),
        ToolCallDelta(0, 0, "", id="call_a", name="f"), ToolCallDelta(0, 0, "{}"),
        ToolCallDelta(0, 1, "", id="call_b", name="g"), ToolCallDelta(0, 1, '{"x":1}'),
        Finished(0, "tool_calls"), Usage(12, 6, 4)]


@pytest.mark.parametrize(("end", "last"), [
    ({"type": "response.incomplete", "response": {
        "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}},
     Finished(0, "length")),
    ({"type": "response.incomplete", "response": {
        "status": "incomplete", "incomplete_details": {"reason": "content_filter"}}},
     Finished(0, "content_filter")),
    ({"type": "response.failed", "response": {
        "status": "failed", "error": {"code": "server_error", "message": "boom"}}},
     Failed(502, "boom", "server_error")),
    ({"type": "error", "code": "rate_limit_exceeded", "message": "slow down"},
     Failed(502, "slow down", "rate_limit_exceeded")),
])
def test_how_a_responses_stream_ends(end, last):
    reader = ResponsesReader()
    events = fed(reader, [{"type": "response.created", "response": RESPONSE}, end])
    assert events[-1] == last
    assert reader.finished == isinstance(last, Finished)


def test_an_error_before_anything_is_only_the_failure():
    # no `Opened`: the router sees the failure first and may still try elsewhere
    assert ResponsesReader().feed({"type": "error", "code": None, "message": "busy"}) == [
        Failed(502, "busy", "upstream_error")]


def test_a_whole_response_is_the_same_events():
    events = ResponsesReader().whole({**RESPONSE, "status": "completed", "usage": USAGE,
                                      "output": [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "id": "msg_1", "content": [
            {"type": "output_text", "text": "Hi", "annotations": []},
            {"type": "refusal", "refusal": "no"}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "f",
         "arguments": "{}"}]})
    assert events == [Opened("resp_up", 7, "gpt-up"), TextDelta(0, "Hi"),
                      OtherDelta(0, {"refusal": "no"}),
                      ToolCallDelta(0, 0, "{}", id="call_a", name="f"),
                      Finished(0, "tool_calls"), Usage(12, 6, 4)]


# ---- the Messages reader ----------------------------------------------------------------------

MESSAGE = {"id": "msg_01up", "type": "message", "role": "assistant", "model": "claude-up",
           "usage": {"input_tokens": 10, "cache_read_input_tokens": 5,
                     "cache_creation_input_tokens": 2, "output_tokens": 1}}


def test_a_messages_stream_becomes_the_chat_events():
    reader = MessagesReader()
    events = fed(reader, [
        {"type": "message_start", "message": {**MESSAGE, "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": {
            "type": "thinking", "thinking": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {
            "type": "thinking_delta", "thinking": "hmm"}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text",
                                                                     "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta",
                                                              "text": "Hi"}},
        {"type": "content_block_stop", "index": 1},
        {"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}},
        {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": '{"a":'}},
        {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": "1}"}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
         "usage": {"output_tokens": 9}},
    ])
    assert not reader.finished
    assert fed(reader, [{"type": "message_stop"}]) == [] and reader.finished
    # the prompt billed is all of it, cached and written to the cache included
    assert without_time(events) == [
        Opened("01up", 0, "claude-up"), TextDelta(0, "Hi"),
        ToolCallDelta(0, 0, "", id="toolu_1", name="f"), ToolCallDelta(0, 0, '{"a":'),
        ToolCallDelta(0, 0, "1}"), Finished(0, "tool_calls"), Usage(17, 9, 5)]


@pytest.mark.parametrize(("delta", "finished"), [
    ({"stop_reason": "end_turn"}, Finished(0, "stop")),
    ({"stop_reason": "stop_sequence", "stop_sequence": "END"}, Finished(0, "stop", "END")),
    ({"stop_reason": "max_tokens"}, Finished(0, "length")),
    ({"stop_reason": "refusal"}, Finished(0, "content_filter")),
])
def test_stop_reasons_become_finish_reasons(delta, finished):
    events = fed(MessagesReader(), [{"type": "message_start", "message": MESSAGE},
                                    {"type": "message_delta", "delta": delta, "usage": {}}])
    assert events[-2] == finished


def test_a_messages_error_event_and_a_whole_message():
    (failed,) = MessagesReader().feed({"type": "error", "error": {
        "type": "overloaded_error", "message": "Overloaded"}})
    assert failed == Failed(502, "Overloaded", "overloaded_error")
    reader = MessagesReader()
    events = reader.whole({**MESSAGE, "stop_reason": "tool_use", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]})
    assert reader.finished
    assert without_time(events) == [
        Opened("01up", 0, "claude-up"), TextDelta(0, "Let me check."),
        ToolCallDelta(0, 0, '{"a": 1}', id="toolu_1", name="f"), Finished(0, "tool_calls"),
        Usage(17, 1, 5)]


# ---- what the surfaces attach -----------------------------------------------------------------

def test_a_messages_body_carries_only_what_was_validated_and_is_sendable():
    request = anthropic.parse(json.dumps({
        "model": "m", "max_tokens": 5, "system": "Be brief.", "stop_sequences": ["x"],
        "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "workspace_id": "ws_1", "inference_geo": "eu", "diagnostics": {"a": 1},
        "thinking": {"type": "disabled"}, "speed": "fast"}).encode())
    native = native_of(request, {"messages"})
    assert native is not None and native.api == "messages"
    assert native.body == {"max_tokens": 5, "system": "Be brief.", "stop_sequences": ["x"],
                           "messages": [{"role": "user", "content": "hi"}]}
    assert json.loads(native.upstream_body("up", stream=False)) == {
        **native.body, "model": "up", "stream": False}


def test_a_messages_call_carries_the_clients_version_and_betas():
    request = anthropic.parse(json.dumps({
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}).encode())
    anthropic.with_headers(request, Headers(raw=[
        (b"anthropic-version", b"2024-10-22"), (b"anthropic-beta", b"b-1, ,a.2"),
        (b"anthropic-beta", b"a.2,c_3")]))
    native = native_of(request, {"messages"})
    assert native is not None and (native.version, native.betas) == ("2024-10-22",
                                                                     ("b-1", "a.2", "c_3"))
    own = {"x-api-key": "sk-a", "anthropic-version": "2023-06-01", "anthropic-beta": "c_3,z"}
    assert native.upstream_headers(own) == {"x-api-key": "sk-a",
                                            "anthropic-version": "2024-10-22",
                                            "anthropic-beta": "c_3,z,b-1,a.2"}
    assert own["anthropic-beta"] == "c_3,z"  # the deployment's own are left as they were
    plain = {"x-api-key": "sk-a", "anthropic-version": "2023-06-01"}
    assert Native("messages", {}).upstream_headers(plain) == plain  # none given: the default
    assert Native("responses", {}, "v", ("b",)).upstream_headers({}) == {}  # Messages only
    with pytest.raises(APIError) as caught:
        anthropic.with_headers(request, Headers(raw=[(b"anthropic-beta", b"a\x00b")]))
    assert (caught.value.status, caught.value.param) == (400, "anthropic-beta")


def test_a_responses_body_is_the_whole_conversation_with_store_off():
    history = [
        {"type": "message", "id": "msg_a", "status": "completed", "role": "user",
         "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "id": "fc_a", "status": "completed", "call_id": "call_1",
         "name": "weather", "arguments": "{}"}]
    body = responses.validate(json.dumps({
        "model": "m", "previous_response_id": "resp_x", "metadata": {"k": "v"},
        "instructions": "Be brief.", "max_output_tokens": 9, "background": False,
        "reasoning": {"effort": "low"}, "tools": [{"type": "function", "name": "weather"}],
        "input": [{"type": "function_call_output", "call_id": "call_1", "output": "18C"}],
    }).encode())
    request = responses.build(body, history=history)
    native = native_of(request, {"responses"})
    assert native is not None and native.api == "responses"
    assert native.body == {
        "instructions": "Be brief.", "max_output_tokens": 9, "reasoning": {"effort": "low"},
        "tools": [{"type": "function", "name": "weather"}], "store": False,
        "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "weather",
                   "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "18C"}]}
    assert responses.turn_of(request).previous_response_id == "resp_x"  # the gateway's


# ---- who speaks what --------------------------------------------------------------------------

def config(**fields: Any) -> DeploymentConfig:
    return DeploymentConfig.model_validate({"name": "d", "model_name": "m", **fields})


def test_which_deployments_speak_which_apis():
    http = {"provider": "openai", "base_url": "http://up/v1"}
    assert config(**http).native() == frozenset()
    assert config(**http, native_apis=["messages"]).native() == {"messages"}
    litellm = {"provider": "litellm", "upstream_model": "x"}
    assert config(**litellm).native("anthropic") == {"messages"}
    assert config(**litellm, base_url="http://proxy").native("anthropic") == {"messages"}
    assert config(**litellm).native("openai") == {"responses"}  # at OpenAI itself
    assert config(**litellm, base_url="http://vllm/v1").native("openai") == frozenset()
    assert config(**litellm).native("bedrock") == frozenset()
    assert config(**litellm, native_apis=[]).native("anthropic") == frozenset()
    for refused in ({"provider": "worker", "base_url": "http://w/v1"},
                    {"provider": "embedded"},
                    {**http, "mode": "embedding"}):
        with pytest.raises(ValidationError, match="native_apis"):
            config(**refused, native_apis=["responses"])


async def test_litellm_finds_the_providers_native_endpoints(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    pool = HttpPool(max_connections=2)
    await pool.open()
    try:
        claude = LiteLLMDeployment(config(provider="litellm", upstream_model="anthropic/c",
                                          base_url="http://127.0.0.1:9", api_key="sk-a"), pool)
        await claude.start()
        assert claude._native == {"messages": ("http://127.0.0.1:9/v1/messages", {
            "x-api-key": "sk-a", "anthropic-version": "2023-06-01",
            "content-type": "application/json"})}
        gpt = LiteLLMDeployment(config(provider="litellm", upstream_model="openai/gpt-4o-mini",
                                       api_key="sk-o"), pool)
        await gpt.start()
        assert gpt._native == {"responses": ("https://api.openai.com/v1/responses", {
            "authorization": "Bearer sk-o", "content-type": "application/json"})}
        signed = LiteLLMDeployment(config(
            provider="litellm", upstream_model="bedrock/anthropic.claude-3-haiku",
            native_apis=["messages"], input_price_per_1m=1), pool)
        with pytest.raises(APIError) as caught:
            await signed.start()
        assert caught.value.param == "native_apis" and "signs" in caught.value.message
        # a default that cannot be set up (no key) is translated; asked for, it is refused
        keyless = {"provider": "litellm", "upstream_model": "anthropic/c",
                   "input_price_per_1m": 1}
        translated = LiteLLMDeployment(config(**keyless), pool)
        await translated.start()
        assert translated._native == {}
        with pytest.raises(APIError, match="API Key"):
            await LiteLLMDeployment(config(**keyless, native_apis=["messages"]), pool).start()
        await translated.close()
        await claude.close()
        await gpt.close()
    finally:
        await pool.close()


# ---- an HTTP upstream's native answers ----------------------------------------------------------

async def native_call(base_url: str, pool: HttpPool, *, stream: bool,
                      timeout_s: float = 30) -> tuple[HttpDeployment, Call]:
    deployment = HttpDeployment(config(provider="openai", base_url=base_url, api_key="sk-u",
                                       upstream_model="up", native_apis=["messages"],
                                       timeout_s=timeout_s), pool)
    request = anthropic.parse(json.dumps({
        "model": "m", "max_tokens": 5, "stream": stream,
        "messages": [{"role": "user", "content": "hi"}]}).encode())
    return deployment, deployment.prepare(request, chat=True, tenant_id="t")


def sse(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


STARTED = sse({"type": "message_start", "message": {**MESSAGE, "content": []}})
TEXT = sse({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": "tok"}})


@pytest.fixture
async def pool() -> AsyncIterator[HttpPool]:
    p = HttpPool(max_connections=4)
    await p.open()
    yield p
    await p.close()


async def test_a_client_leaving_closes_the_upstream_stream(pool):
    left = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await resp.write(STARTED)
            for _ in range(1000):
                await resp.write(TEXT)
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            left.set()
            raise
        return resp

    async with loopback_upstream(endless, ("/v1/messages",)) as base:
        deployment, call = await native_call(base, pool, stream=True)
        events = deployment.open(call, request_id="r")
        assert isinstance(await anext(events), Opened)
        assert await anext(events) == TextDelta(0, "tok")
        await events.aclose()  # type: ignore[attr-defined]
        await asyncio.wait_for(left.wait(), 3)


@pytest.mark.parametrize(("answer", "raised"), [
    (web.json_response({"type": "error", "error": {"type": "overloaded_error",
                                                   "message": "Overloaded"}}, status=529),
     UpstreamFailure),
    (web.json_response({"type": "error", "error": {
        "type": "invalid_request_error", "message": "prompt is too long: 9 > 5 maximum"}},
        status=400), APIError),
    (web.Response(body=b"not json", content_type="application/json"), UpstreamFailure),
])
async def test_failures_before_the_first_event_raise_for_the_router(pool, answer, raised):
    async def handler(_request: web.Request) -> web.StreamResponse:
        return answer

    async with loopback_upstream(handler, ("/v1/messages",)) as base:
        deployment, call = await native_call(base, pool, stream=False)
        with pytest.raises(raised) as caught:
            await anext(deployment.open(call, request_id="r"))
    if raised is APIError:  # a prompt too long moves on to a larger window
        assert caught.value.code == "context_length_exceeded"


async def test_a_stream_cut_before_its_end_fails_billing_what_came(pool):
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STARTED + TEXT + TEXT)
        return resp  # no message_delta, no message_stop

    async with loopback_upstream(cut, ("/v1/messages",)) as base:
        deployment, call = await native_call(base, pool, stream=True)
        events = [event async for event in deployment.open(call, request_id="r")]
    assert events[-1] == Failed(502, "the upstream ended the stream early", "upstream_error")
    assert (call.usage.completion_tokens, call.usage.finished) == (2, False)


def test_a_deployment_that_does_not_serve_the_api_never_makes_the_native_body(monkeypatch):
    made = []
    real = responses.native_body
    monkeypatch.setattr("gateway.surfaces.responses.translate.native_body",
                        lambda *a: made.append(1) or real(*a))
    request = responses.parse(json.dumps({"model": "m", "input": "hi"}).encode())
    assert native_api(request) == "responses"
    assert native_of(request, {"messages"}) is None and native_of(request, ()) is None
    assert made == []  # the body costs a model dump: not paid for a translating deployment
    native = native_of(request, {"responses"})
    assert native is not None and made == [1]
    assert native.body["input"][0]["content"][0]["text"] == "hi"
    assert native_of(request, {"responses"}) is native and made == [1]  # made once
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert native_api(chat) is None and native_of(chat, {"responses", "messages"}) is None
