"""Tool calls through the engine's OpenAI client on a tiny random Llama: forced functions and
`required` are constrained to valid calls, `auto` parses Hermes blocks out of the text, and a
streamed answer carries exactly the calls and content of the non-streamed one."""

from __future__ import annotations

import json

import jsonschema
import pytest

from workers import AsyncLLMEngine, LLMEngine
from workers.client import EmbeddedClient
from workers.engine.sampling_params import InvalidRequestError
from workers.protocol.render import sse
from workers.tools.hermes import ParsedCall

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
NOW = {"type": "function", "function": {
    "name": "now", "parameters": {"type": "object", "additionalProperties": False,
                                  "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                  "required": ["tz"]}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "now": NOW["function"]["parameters"]}
HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>')


@pytest.fixture
async def client(tiny_llama_path):
    core = LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=8 << 20)
    engine = AsyncLLMEngine.from_engine(core)
    await engine.start()
    yield EmbeddedClient(engine, "tiny")
    await engine.shutdown()


def body(**extra):
    return {"messages": [{"role": "user", "content": "Weather in Paris for two days?"}],
            "tools": [WEATHER, NOW], "temperature": 0, "max_tokens": 160, **extra}


async def both(client, payload):
    """The non-streamed message and the message rebuilt from the stream's deltas."""
    whole = await client.complete(client.prepare(payload, chat=True), request_id="a")
    stream = sse(client.events(client.prepare(payload, chat=True), request_id="b"),
                 chat=True, include_usage=True)
    chunks = [json.loads(line[6:]) async for line in _events(stream)]
    return whole, chunks


async def _events(stream):
    async for raw in stream:
        for line in raw.decode().split("\n"):
            if line.startswith("data: {"):
                yield line


def rebuild(chunks):
    """Fold stream chunks as the openai client does: content joined, calls by index."""
    content, calls, finish, role = "", {}, None, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            role = delta.get("role", role)
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": None, "name": None, "args": ""})
                slot["id"] = call.get("id", slot["id"])
                fn = call.get("function", {})
                slot["name"] = fn.get("name", slot["name"])
                slot["args"] += fn.get("arguments", "")
            finish = choice["finish_reason"] or finish
    return role, content, [calls[i] for i in sorted(calls)], finish


def check_same(whole, chunks):
    choice = whole["choices"][0]
    role, content, calls, finish = rebuild(chunks)
    assert role == "assistant" and finish == choice["finish_reason"]
    assert content == (choice["message"]["content"] or "")
    expected = choice["message"].get("tool_calls") or []
    assert [(c["name"], c["args"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected]
    assert all(c["id"].startswith("call_") for c in calls)
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


async def test_a_named_function_always_gets_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, chunks = await both(client, body(tool_choice=named))
    message = whole["choices"][0]["message"]
    assert message["content"] is None and whole["choices"][0]["finish_reason"] == "stop"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])
    check_same(whole, chunks)


@pytest.mark.parametrize("parallel", [True, False])
async def test_required_makes_at_least_one_valid_call(client, parallel):
    whole, chunks = await both(client, body(tool_choice="required",
                                            parallel_tool_calls=parallel, seed=7,
                                            temperature=1.0))
    choice = whole["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and len(calls) >= 1
    assert parallel or len(calls) == 1
    assert len({c["id"] for c in calls}) == len(calls)
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])
    check_same(whole, chunks)


@pytest.mark.parametrize("max_tokens", [3, 8, 14])
async def test_required_cut_short_is_a_partial_call_never_content(client, max_tokens):
    """Issue 39: cut by max_tokens, `required` answered 200 with the grammar's partial text
    as content ('[{"name": "get_weather'). The call it was cut in is a call, its arguments as
    far as written, and the finish says `length`."""
    whole, chunks = await both(client, body(tool_choice="required", max_tokens=max_tokens))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length"
    assert not choice["message"]["content"]  # no tool JSON as text (None, or "" with no call)
    calls = choice["message"].get("tool_calls") or []
    assert len(calls) == (0 if max_tokens == 3 else 1)  # 3 tokens end before the name
    for call in calls:
        assert call["function"]["name"] in SCHEMAS
        assert '"name"' not in call["function"]["arguments"]
    check_same(whole, chunks)


def test_held_calls_reads_a_cut_array():
    from workers.tools.processor import held_calls

    names = ["get_weather", "get_time"]
    assert held_calls('[{"name": "get_weather", "arguments": {"city": "Pa', names) == [
        ParsedCall("get_weather", '{"city": "Pa')]
    assert held_calls('[{"name": "get_wea', names) == [ParsedCall("get_weather", "")]
    assert held_calls('[{"name": "get_', names) == []  # two tools begin so
    assert held_calls("[", names) == [] and held_calls("", names) == []
    assert held_calls('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                      '"arguments": {"ci', names) == [
        ParsedCall("get_time", "{}"), ParsedCall("get_weather", '{"ci')]


async def test_auto_parses_hermes_blocks_out_of_the_text(client):
    # The regex makes this random model write a Hermes block, as a tool-trained model would.
    forced = {"structured_outputs": {"regex": "Checking\\. " + _escape(HERMES)}}
    whole, chunks = await both(client, body(tool_choice="auto", **forced))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather",
                                "arguments": json.dumps({"city": "Paris", "days": 2})}
    check_same(whole, chunks)


async def test_tool_choice_none_leaves_the_text_alone(client):
    forced = {"structured_outputs": {"regex": _escape(HERMES)}}
    whole, _ = await both(client, body(tool_choice="none", **forced))
    choice = whole["choices"][0]
    assert choice["message"]["content"] == HERMES and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


async def test_a_tool_round_trip_is_accepted(client):
    payload = body(tool_choice="auto", max_tokens=4)
    payload["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]
    call = client.prepare(payload, chat=True)
    prompt = client.engine.tokenizer.decode(call.request.prompt_token_ids)
    assert "<tool_response>\n18C, sunny\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt
    whole = await client.complete(call, request_id="rt")
    assert whole["usage"]["completion_tokens"] == 4


def test_required_with_a_response_format_is_refused(client):
    with pytest.raises(InvalidRequestError) as info:
        client.prepare(body(tool_choice="required",
                            response_format={"type": "json_object"}), chat=True)
    assert info.value.param == "tool_choice"


def _escape(text: str) -> str:
    out = []
    for ch in text:
        out.append("\\n" if ch == "\n" else ("\\" + ch if ch in '\\.^$|?*+()[]{}' else ch))
    return "".join(out)


async def test_a_model_can_use_the_llama3_json_parser(client):
    client.tool_call_parser = "llama3_json"
    text = '{"name": "now", "parameters": {"tz": "UTC"}}'
    whole, chunks = await both(client, body(structured_outputs={"regex": _escape(text)}))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "now", "arguments": '{"tz": "UTC"}'}
    check_same(whole, chunks)
