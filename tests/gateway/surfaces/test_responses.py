"""OpenAI's Responses API: the body (and a stored conversation) parsed into the canonical chat
request, answers rendered as the Response object and its typed stream (checked against the
`openai` SDK's own types), refusals by name; then the official `openai` client against a live
gateway on loopback over the real engine (a tiny random Llama): create, stream, retrieve,
input items, delete, previous_response_id, a function-calling round trip, typed errors."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.app import create_app
from gateway.errors import APIError
from gateway.surfaces import responses as surface
from tenancy import stored_responses
from tests.gateway.support import live, seed_tenant, settings
from workers.async_engine import AsyncLLMEngine
from workers.protocol.events import Failed, Finished, Opened, TextDelta, ToolCallDelta, Usage
from workers.protocol.render import Fold

WEATHER = {"type": "function", "name": "weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def body(**fields) -> bytes:
    fields.setdefault("model", "m")
    fields.setdefault("input", "hi")
    return json.dumps(fields).encode()


def test_items_instructions_and_tools_become_the_chat_request():
    chat = surface.parse(body(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Weather in Paris?"},
                {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather",
             "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {"role": "user", "content": "And tomorrow?"}],
        tools=[WEATHER], tool_choice={"type": "function", "name": "weather"},
        temperature=0.5, top_p=0.9, max_output_tokens=12, parallel_tool_calls=False,
        safety_identifier="u-42", user="u-1", metadata={"k": "v"},
        text={"format": {"type": "json_schema", "name": "out", "strict": True,
                         "schema": {"type": "object"}}}))
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "developer", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief."
    assert [p.type for p in chat.messages[2].content] == ["text", "image_url"]
    assistant = chat.messages[3]
    assert assistant.content == "Checking."
    call = assistant.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == (
        "call_1", "weather", '{"city": "Paris"}')
    assert chat.messages[4].tool_call_id == "call_1" and chat.messages[4].content == "18C"
    assert chat.tools[0].function.name == "weather"
    assert chat.tools[0].function.parameters == WEATHER["parameters"]
    assert chat.tool_choice.function.name == "weather"
    assert (chat.temperature, chat.top_p, chat.max_tokens, chat.parallel_tool_calls) == (
        0.5, 0.9, 12, False)
    assert (chat.user, chat.safety_identifier, chat.metadata) == ("u-1", "u-42", None)
    assert chat.response_format.json_schema.name == "out"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    turn = surface.turn_of(chat)
    assert turn.response_id.startswith("resp_") and turn.store
    assert turn.echo["metadata"] == {"k": "v"} and turn.echo["tools"][0]["name"] == "weather"
    assert [item["type"] for item in turn.input_items] == [
        "message", "message", "message", "function_call", "function_call_output", "message"]
    assert all(item["id"] for item in turn.input_items)


def test_a_string_input_is_one_user_message_and_defaults_are_echoed():
    chat = surface.parse(body(input="Say hi", stream=True, tools=[WEATHER],
                              tool_choice="required", reasoning={"effort": "none"},
                              text={"format": {"type": "json_object"}}, store=False))
    assert [(m.role, m.content) for m in chat.messages] == [("user", "Say hi")]
    assert chat.stream and chat.stream_options.include_usage
    assert chat.tool_choice == "required" and chat.reasoning_effort is None
    assert chat.response_format.type == "json_object"
    turn = surface.turn_of(chat)
    assert not turn.store
    assert turn.echo["temperature"] == 1.0 and turn.echo["parallel_tool_calls"]
    assert turn.echo["truncation"] == "disabled" and turn.echo["tool_choice"] == "required"


def test_reasoning_effort_and_allowed_tools():
    chat = surface.parse(body(reasoning={"effort": "xhigh", "summary": "auto"},
                              tools=[WEATHER, {**WEATHER, "name": "time"}],
                              tool_choice={"type": "allowed_tools", "mode": "required",
                                           "tools": [{"type": "function", "name": "time"}]}))
    assert chat.reasoning_effort == "high"
    assert [t.function.name for t in chat.tools] == ["time"] and chat.tool_choice == "required"
    plain = surface.parse(body(tool_choice="auto", parallel_tool_calls=True))
    assert plain.tool_choice is None and plain.parallel_tool_calls is None  # nothing to call


def test_a_continuation_is_the_stored_conversation_then_the_new_input():
    previous_input = surface.input_items("What is the weather?", set())
    previous_output = [
        {"type": "function_call", "id": "fc_x_0", "call_id": "call_7", "name": "weather",
         "arguments": "{}", "status": "completed"}]
    raw = json.loads(body(input=[{"type": "function_call_output", "call_id": "call_7",
                                  "output": [{"type": "input_text", "text": "18C"}]}],
                          previous_response_id="resp_prev", instructions="New rules."))
    checked = surface.ResponsesRequest.model_validate(raw)
    chat = surface.build(checked, history=[*previous_input, *previous_output])
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "New rules."), ("user", "What is the weather?"), ("assistant", None),
        ("tool", "18C")]
    assert chat.messages[2].tool_calls[0].id == "call_7"
    turn = surface.turn_of(chat)
    assert turn.previous_response_id == "resp_prev" and len(turn.history) == 2


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0.type"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                 "environment": "linux"}]}, "tools.0.type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
     "tools.0.type"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "https://x"}]},
     "tools.0.type"),
    ({"tools": [{"type": "image_generation"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["nope"]}, "include.0"),
    ({"seed": 1}, "seed"),
    ({"temperature": 3}, "temperature"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input.0.content.0.image_url"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input.0.call_id"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input.0.call_id"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
])
def test_what_is_not_served_is_a_400_naming_it(fields, param):
    with pytest.raises(APIError) as caught:
        surface.parse(body(**fields))
    assert caught.value.status == 400
    assert caught.value.param == param, caught.value.message


def test_previous_response_id_needs_the_tenant():
    with pytest.raises(APIError) as caught:
        surface.parse(body(previous_response_id="resp_1"))
    assert caught.value.param == "previous_response_id"


# ---- answers --------------------------------------------------------------------------------

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def request(**fields):
    return surface.parse(body(**fields))


def folded(events) -> Fold:
    fold = Fold(chat=True)
    for event in events:
        fold.add(event)
    return fold


TOOL_ANSWER = [Opened("resp-abc", 1, "m"), TextDelta(0, "Let me look."),
               ToolCallDelta(0, 0, '{"city": ', id="call_1", name="weather"),
               ToolCallDelta(0, 0, '"Paris"}'), Finished(0, "tool_calls"), Usage(12, 7, 4)]


def test_a_whole_answer_is_a_response_object():
    chat = request(tools=[WEATHER], metadata={"k": "v"}, max_output_tokens=30)
    turn = surface.turn_of(chat)
    answer = surface.whole(chat, folded(TOOL_ANSWER))
    parsed = Response.model_validate(answer)
    assert parsed.id == turn.response_id and parsed.object == "response"
    assert parsed.status == "completed" and parsed.incomplete_details is None
    assert parsed.output_text == "Let me look."
    message, call = parsed.output
    assert message.type == "message" and message.id == f"msg_{turn.hex}"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert (call.type, call.call_id, call.name, call.arguments, call.status) == (
        "function_call", "call_1", "weather", '{"city": "Paris"}', "completed")
    assert call.id.startswith("fc_")
    assert answer["usage"] == {
        "input_tokens": 12, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 19}
    assert parsed.metadata == {"k": "v"} and parsed.max_output_tokens == 30
    assert parsed.tools[0].name == "weather" and parsed.tool_choice == "auto"
    assert parsed.store is True and parsed.completed_at is not None


def test_cut_short_is_incomplete_with_its_reason():
    chat = request(max_output_tokens=2)
    answer = surface.whole(chat, folded([Opened("x", 1, "m"), TextDelta(0, "Hello"),
                                         Finished(0, "length"), Usage(3, 2)]))
    assert answer["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["output"][0]["status"] == "incomplete" and answer["completed_at"] is None
    Response.model_validate(answer)


def events_of(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind.removeprefix("event: ") == event["type"]
        STREAM_EVENT.validate_python(event)  # the SDK's own types parse every event
        out.append(event)
    return out


def streamed(chat, answer) -> list[dict]:
    renderer = surface.StreamRenderer(chat, 12)
    return events_of(b"".join(renderer.render(e) for e in answer) + renderer.done())


def test_the_stream_follows_the_responses_event_order():
    chat = request(tools=[WEATHER], stream=True)
    events = streamed(chat, TOOL_ANSWER)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress"
    assert events[9]["output_index"] == 1
    assert events[11]["arguments"] == '{"city": "Paris"}' and events[11]["name"] == "weather"
    # the final object is the one `whole` gives (and the store keeps)
    assert events[-1]["response"] == surface.whole(chat, folded(TOOL_ANSWER))
    assert events[7]["item"] == events[-1]["response"]["output"][0]
    assert events[12]["item"] == events[-1]["response"]["output"][1]


def test_a_stream_cut_short_ends_incomplete_and_an_empty_answer_still_has_its_message():
    chat = request(stream=True, max_output_tokens=2)
    events = streamed(chat, [Opened("x", 1, "m"), TextDelta(0, "Hi"), Finished(0, "length"),
                             Usage(3, 2)])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    empty = streamed(request(stream=True), [Opened("x", 1, "m"), Finished(0, "stop")])
    assert [e["type"] for e in empty][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert empty[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_failure_mid_stream_is_an_error_then_response_failed():
    chat = request(stream=True)
    renderer = surface.StreamRenderer(chat, 3)
    raw = b"".join(renderer.render(e) for e in [
        Opened("x", 1, "m"), TextDelta(0, "Hi"), Failed(503, "worker lost", "overloaded")])
    events = events_of(raw)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error",
                                               "message": "worker lost"}


def test_logprobs_are_given_when_included():
    chat = request(include=["message.output_text.logprobs"], top_logprobs=2, stream=True)
    assert chat.logprobs and chat.top_logprobs == 2
    piece = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
             "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}
    answer = [Opened("x", 1, "m"), TextDelta(0, "Hi", {"content": [piece]}),
              Finished(0, "stop"), Usage(1, 1)]
    events = streamed(chat, answer)
    assert events[4]["logprobs"] == [piece]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == [piece]


# ---- live, with the official client ---------------------------------------------------------

@pytest.fixture
async def served(sqlite_url, tmp_path, tiny_llama_path, monkeypatch):
    # a missing fresh id is looked for again this long (another replica's write), not 2 s
    monkeypatch.setattr(stored_responses, "FRESH_S", 0.2)
    tenant = await seed_tenant(sqlite_url, tmp_path, name="codex", plan={"rpm": 1000})
    other = await seed_tenant(sqlite_url, tmp_path, name="other", plan={"rpm": 1000})
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=32 << 20)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny"})
    with live(cfg, create_app(cfg, engine=engine)) as port:
        yield f"http://127.0.0.1:{port}/v1", tenant, other


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)


NOW = {"type": "function", "name": "now", "strict": True,
       "parameters": {"type": "object", "additionalProperties": False,
                      "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}
VERDICT = {"type": "json_schema", "name": "verdict", "strict": True, "schema": {
    "type": "object", "additionalProperties": False,
    "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}


async def test_the_official_client_creates_retrieves_lists_and_deletes(served):
    url, tenant, _ = served
    async with client(url, tenant.key) as sdk:
        response = await sdk.responses.create(
            model="tiny", input="Say hi", instructions="You are terse.", max_output_tokens=6,
            temperature=0, metadata={"run": "1"})
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].type == "message" and response.output_text
        assert response.usage.output_tokens == 6 and response.usage.input_tokens > 5
        assert response.usage.total_tokens == response.usage.input_tokens + 6
        assert response.instructions == "You are terse." and response.metadata == {"run": "1"}

        again = await sdk.responses.retrieve(response.id)
        assert again.model_dump() == response.model_dump()
        items = await sdk.responses.input_items.list(response.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
            ("message", "user", "Say hi")]

        await sdk.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.delete(response.id)

        unkept = await sdk.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                            store=False)
        assert unkept.store is False
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(unkept.id)


async def test_the_official_client_streams_the_same_answer(served):
    url, tenant, _ = served
    ask = {"model": "tiny", "input": "Is water wet?", "temperature": 0,
           "text": {"format": VERDICT}}
    async with client(url, tenant.key) as sdk:
        whole = await sdk.responses.create(**ask)
        assert whole.status == "completed" and json.loads(whole.output_text).keys() == {"ok"}
        async with sdk.responses.stream(**ask) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
        assert final.output_text == whole.output_text and final.status == "completed"
        assert final.usage.output_tokens == whole.usage.output_tokens
        # queued before the last byte: found at once
        stored = await sdk.responses.retrieve(final.id)
        assert stored.output_text == final.output_text
        # a deterministic ask again is a cache hit: a response of its own, kept too
        raw = await sdk.responses.with_raw_response.create(**ask)
        hit = raw.parse()
        assert raw.headers["x-cache"] == "hit" and hit.id not in (whole.id, final.id)
        assert hit.output_text == whole.output_text and hit.status == "completed"
        assert (await sdk.responses.retrieve(hit.id)).output_text == whole.output_text

        raw = await sdk.responses.create(model="tiny", input="Count", max_output_tokens=4,
                                         temperature=0, stream=True)
        events = [event async for event in raw]
        assert events[-1].type == "response.incomplete"
        assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_function_call_round_trip_continues_the_stored_conversation(served):
    url, tenant, _ = served
    async with client(url, tenant.key) as sdk:
        first = await sdk.responses.create(
            model="tiny", input="What time is it in Paris?", tools=[NOW],
            tool_choice={"type": "function", "name": "now"}, temperature=0)
        assert first.status == "completed"
        (call,) = [item for item in first.output if item.type == "function_call"]
        assert call.name == "now" and json.loads(call.arguments)["tz"] in ("UTC", "CET")
        second = await sdk.responses.create(
            model="tiny", previous_response_id=first.id, tools=[NOW], max_output_tokens=4,
            temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                   "output": "12:00"}])
        assert second.previous_response_id == first.id and second.output_text
        # a call streamed (asked anew, not from the cache): the SDK folds its deltas
        async with sdk.responses.stream(
                model="tiny", input="And in Berlin?", tools=[NOW],
                tool_choice={"type": "function", "name": "now"}, temperature=0,
                store=False) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        (again,) = [item for item in streamed.output if item.type == "function_call"]
        assert again.name == "now" and json.loads(again.arguments)["tz"] in ("UTC", "CET")
        assert again.call_id.startswith("call_") and again.status == "completed"
        # the history (first input, the call, its output) reached the model
        assert second.usage.input_tokens > first.usage.input_tokens
        third = await sdk.responses.create(model="tiny", previous_response_id=second.id,
                                           input="Thanks", max_output_tokens=2, tools=[NOW],
                                           temperature=0)  # tools are not carried over
        assert third.usage.input_tokens > second.usage.input_tokens
        # an output answering no call of the conversation is refused by name
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(model="tiny", input=[{
                "type": "function_call_output", "call_id": "call_nope", "output": "x"}])
        assert caught.value.body["param"] == "input.0.call_id"


async def test_errors_reach_the_client_typed(served):
    url, tenant, _ = served
    async with client(url, "sk-sb-nope-nope") as sdk:
        with pytest.raises(openai.AuthenticationError):
            await sdk.responses.create(model="tiny", input="hi")
    async with client(url, tenant.key) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(model="tiny", input="hi",
                                       tools=[{"type": "web_search"}])
        assert caught.value.body["param"] == "tools.0.type"
        assert "web_search" in caught.value.message
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.responses.create(model="tiny", input="hi",
                                       previous_response_id="resp_nope")
        assert caught.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.create(model="no-such-model", input="hi")
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(model="tiny", input="hi", reasoning={"effort": "high"})
        assert caught.value.body["param"] == "reasoning_effort"  # the engine does not reason


async def test_another_tenant_cannot_see_or_continue_a_response(served):
    url, tenant, other = served
    async with client(url, tenant.key) as mine, client(url, other.key) as theirs:
        response = await mine.responses.create(model="tiny", input="secret",
                                               max_output_tokens=2)
        for attempt in (theirs.responses.retrieve(response.id),
                        theirs.responses.delete(response.id),
                        theirs.responses.input_items.list(response.id),
                        theirs.responses.create(model="tiny", input="more",
                                                previous_response_id=response.id)):
            with pytest.raises(openai.NotFoundError):
                await attempt
        assert (await mine.responses.retrieve(response.id)).id == response.id
