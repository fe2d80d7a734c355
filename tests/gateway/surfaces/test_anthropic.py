"""Anthropic's Messages API: the body parsed into the canonical chat request, answers rendered
in its shape (whole and streamed), errors in its shape; then the official `anthropic` client
against a live gateway on loopback, over the real engine (a tiny random Llama)."""

from __future__ import annotations

import json

import anthropic
import pytest

from gateway.app import create_app
from gateway.errors import APIError
from gateway.surfaces import anthropic as surface
from tests.gateway.support import live, seed_tenant, settings
from workers.async_engine import AsyncLLMEngine
from workers.protocol.events import Finished, Opened, TextDelta, ToolCallDelta, Usage
from workers.protocol.render import Fold


def body(**fields) -> bytes:
    fields.setdefault("model", "m")
    fields.setdefault("max_tokens", 8)
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps(fields).encode()


def test_system_tools_and_history_become_the_chat_request():
    chat = surface.parse(body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "text", "text": "And tomorrow?"}]}],
        tools=[{"name": "weather", "description": "Weather now",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        tool_choice={"type": "any"}, stop_sequences=["\n\n"], temperature=0.5, top_k=5,
        metadata={"user_id": "u-42"}))
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief.\n\nBe kind."
    call = chat.messages[2].tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1", "weather", {"city": "Paris"})
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "18C"
    assert chat.tool_choice == "required" and chat.tools[0].function.name == "weather"
    assert (chat.stop, chat.temperature, chat.top_k, chat.user, chat.max_tokens) == (
        ["\n\n"], 0.5, 5, "u-42", 8)


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"temperature": 1.5}, "temperature"),
    ({"surprise": 1}, "surprise"),
    ({"container": "c-1"}, "container"),
])
def test_what_is_not_served_is_a_400_naming_it(fields, param):
    raw = body(**fields)
    if fields.get("max_tokens", 1) is None:
        raw = json.dumps({k: v for k, v in json.loads(raw).items() if k != "max_tokens"}).encode()
    with pytest.raises(APIError) as caught:
        surface.parse(raw)
    assert caught.value.status == 400
    assert caught.value.param == param, caught.value.message


def test_structured_output_becomes_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = surface.parse(body(output_config={"format": {"type": "json_schema",
                                                        "schema": schema}, "effort": "low"}))
    assert chat.response_format.json_schema.schema_ == schema


def test_a_tool_result_for_no_call_is_refused():
    with pytest.raises(APIError) as caught:
        surface.parse(body(messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]))
    assert caught.value.status == 400


def folded(events) -> Fold:
    fold = Fold(chat=True)
    for event in events:
        fold.add(event)
    return fold


def test_a_whole_answer_is_an_anthropic_message():
    fold = folded([Opened("msg-abc", 1, "m"), TextDelta(0, "Let me look."),
                   ToolCallDelta(0, 0, '{"city": "Paris"}', id="call_1", name="weather"),
                   Finished(0, "tool_calls"), Usage(12, 7, 4)])
    message = surface.whole(fold.response(), stop_sequence=fold.stop_sequence())
    assert message["id"] == "msg_abc" and message["type"] == "message"
    assert message["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}}]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 8, "output_tokens": 7,
                                "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0}


@pytest.mark.parametrize(("reason", "stop", "expected"), [
    ("stop", None, "end_turn"), ("stop", "END", "stop_sequence"), ("length", None, "max_tokens"),
    ("tool_calls", None, "tool_use")])
def test_stop_reasons(reason, stop, expected):
    fold = folded([Opened("x", 1, "m"), TextDelta(0, "a"), Finished(0, reason, stop)])
    message = surface.whole(fold.response(), stop_sequence=fold.stop_sequence())
    assert message["stop_reason"] == expected
    assert message["stop_sequence"] == stop


def events_of(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_the_stream_follows_anthropics_event_order():
    renderer = surface.StreamRenderer(prompt_tokens=9, model="m")
    raw = b"".join(renderer.render(e) for e in [
        Opened("msg-1", 1, "m"), TextDelta(0, "Hi"), TextDelta(0, " there"),
        ToolCallDelta(0, 0, '{"a"', id="call_9", name="f"), ToolCallDelta(0, 0, ': 1}'),
        Finished(0, "tool_calls"), Usage(9, 5)]) + renderer.done()
    events = events_of(raw)
    assert [kind for kind, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 9
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "call_9", "name": "f",
                                             "input": {}}
    assert "".join(e["delta"]["partial_json"] for k, e in events[7:9]) == '{"a": 1}'
    assert events[10][1]["delta"]["stop_reason"] == "tool_use"
    assert events[10][1]["usage"] == {"output_tokens": 5}


def test_errors_take_anthropics_shape_and_overloaded_is_529():
    response = APIError(503, "busy", type_="server_error").response("/v1/messages")
    assert response.status_code == 529
    assert json.loads(response.body) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "busy"}}
    openai_shaped = APIError(503, "busy").response("/v1/chat/completions")
    assert openai_shaped.status_code == 503 and "type" not in json.loads(openai_shaped.body)


# ---- live, with the official client ---------------------------------------------------------

@pytest.fixture
async def served(sqlite_url, tmp_path, tiny_llama_path):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="claude", plan={"rpm": 1000})
    other = await seed_tenant(sqlite_url, tmp_path, name="other", plan={"rpm": 1000})
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=32 << 20)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny"})
    with live(cfg, create_app(cfg, engine=engine)) as port:
        yield f"http://127.0.0.1:{port}", tenant, other


def client(url: str, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


async def test_the_official_client_gets_a_message(served):
    url, tenant, _ = served
    async with client(url, tenant.key) as claude:
        message = await claude.messages.create(
            model="tiny", max_tokens=6, system="You are terse.", cache_control={
                "type": "ephemeral"}, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "Say hi"}])
        assert message.type == "message" and message.role == "assistant"
        assert message.stop_reason == "max_tokens"
        assert message.usage.output_tokens == 6 and message.usage.input_tokens > 5
        assert message.content[0].type == "text" and message.content[0].text
        counted = await claude.messages.count_tokens(
            model="tiny", system="You are terse.",
            messages=[{"role": "user", "content": "Say hi"}])
        assert counted.input_tokens == message.usage.input_tokens


async def test_the_official_client_streams_the_same_text(served):
    url, tenant, _ = served
    ask = {"model": "tiny", "max_tokens": 6, "extra_body": {"temperature": 0},
           "messages": [{"role": "user", "content": "Count to three"}]}
    async with client(url, tenant.key) as claude:
        whole = await claude.messages.create(**ask)
        async with claude.messages.stream(**ask) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


async def test_errors_reach_the_client_typed(served):
    url, tenant, _ = served
    async with client(url, "sk-sb-nope-nope") as claude:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await claude.messages.create(model="tiny", max_tokens=4,
                                         messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
    async with client(url, tenant.key) as claude:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await claude.messages.create(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                thinking={"type": "enabled", "budget_tokens": 1024})
        assert "thinking" in caught.value.message
        with pytest.raises(anthropic.NotFoundError):
            await claude.messages.create(model="no-such-model", max_tokens=4,
                                         messages=[{"role": "user", "content": "hi"}])


async def test_the_bearer_header_works_too(served):
    url, tenant, _ = served
    async with anthropic.AsyncAnthropic(base_url=url, auth_token=tenant.key,
                                        max_retries=0) as claude:
        message = await claude.messages.create(model="tiny", max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens == 2
