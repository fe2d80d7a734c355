"""Events to OpenAI JSON and SSE and back: a response read into events folds back to itself,
chunks carry what OpenAI's carry, and nothing an upstream adds is lost on the way."""

from __future__ import annotations

import json
from typing import Any

import pytest

from workers.protocol.events import (
    Failed,
    Finished,
    Opened,
    OtherDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
    started,
)
from workers.protocol.render import (
    DONE,
    Fold,
    StreamRenderer,
    events_of_chunk,
    events_of_response,
    opened_of,
    replay,
    sse,
)

CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_2", "type": "function",
          "function": {"name": "get_time", "arguments": "{}"}}]
USAGE = {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
         "prompt_tokens_details": {"cached_tokens": 4},
         "completion_tokens_details": {"reasoning_tokens": 0}}
CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "m",
        "system_fingerprint": "fp_1", "usage": USAGE,
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                     "message": {"role": "assistant", "content": None, "tool_calls": CALLS}},
                    {"index": 1, "finish_reason": "stop",
                     "logprobs": {"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                                               "top_logprobs": []}]},
                     "message": {"role": "assistant", "content": "Hi",
                                 "annotations": [{"type": "url_citation"}]}}]}
TEXT = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "text": "Hello there", "finish_reason": "length",
                     "logprobs": {"tokens": ["Hello", " there"],
                                  "token_logprobs": [-0.1, -0.2],
                                  "top_logprobs": [{"Hello": -0.1}, {" there": -0.2}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                  "prompt_tokens_details": {"cached_tokens": 0}}}


def fold_of(events: list[Any], *, chat: bool) -> dict[str, Any]:
    fold = Fold(chat=chat)
    for event in events:
        fold.add(event)
    assert fold.complete
    return fold.response()


@pytest.mark.parametrize("response, chat", [(CHAT, True), (TEXT, False)])
def test_a_response_read_into_events_folds_back_to_itself(response, chat):
    assert fold_of(events_of_response(response, chat=chat), chat=chat) == response


def chunks_of(raw: list[bytes]) -> list[dict[str, Any]]:
    assert raw[-1] == DONE
    return [json.loads(r[len(b"data: "):]) for r in raw[:-1]]


@pytest.mark.parametrize("response, chat", [(CHAT, True), (TEXT, False)])
def test_a_stream_read_back_folds_to_the_same_response(response, chat):
    """Rendered as chunks, parsed as an upstream's stream, folded: the response again."""
    raw = replay(events_of_response(response, chat=chat),
                 StreamRenderer(chat=chat, include_usage=True))
    chunks = chunks_of(raw)
    events: list[Any] = [opened_of(chunks[0])]
    for chunk in chunks:
        events += events_of_chunk(chunk, chat=chat)
    assert fold_of(events, chat=chat) == response


def test_chat_chunks_are_shaped_as_openai_streams_them():
    renderer = StreamRenderer(chat=True, include_usage=False)
    renderer.render(Opened("c", 1, "m"))
    first = json.loads(renderer.render(ToolCallDelta(0, 0, "", id="call_1", name="f"))[6:])
    assert first == {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "logprobs": None, "finish_reason": None,
                                  "delta": {"role": "assistant", "content": None,
                                            "tool_calls": [{"index": 0, "id": "call_1",
                                                            "type": "function",
                                                            "function": {"name": "f",
                                                                         "arguments": ""}}]}}]}
    later = json.loads(renderer.render(ToolCallDelta(0, 0, '{"a":1}'))[6:])
    assert later["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"a":1}'}}]}
    text = json.loads(renderer.render(TextDelta(1, "x"))[6:])  # another choice: its own role
    assert text["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    last = json.loads(renderer.render(Finished(0, "tool_calls"))[6:])
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": "tool_calls"}
    assert renderer.render(Usage(1, 2)) == b""  # not asked for


def test_usage_comes_last_and_null_before_when_asked():
    raw = replay([Opened("c", 1, "m"), TextDelta(0, "a b"), Finished(0, "stop"),
                  Usage(3, 2, 1, {"completion_tokens_details": {"reasoning_tokens": 0}})],
                 StreamRenderer(chat=True, include_usage=True))
    chunks = chunks_of(raw)
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:2]] == ["a", " b"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                   "total_tokens": 5, "prompt_tokens_details":
                                   {"cached_tokens": 1},
                                   "completion_tokens_details": {"reasoning_tokens": 0}}


def test_what_an_upstream_adds_comes_through():
    chunk = {"id": "c", "created": 1, "model": "m", "service_tier": "default",
             "choices": [{"index": 0, "finish_reason": None,
                          "delta": {"refusal": "I can't", "content": None}}]}
    events = events_of_chunk(chunk, chat=True)
    assert events == [OtherDelta(0, {"refusal": "I can't"})]
    assert opened_of(chunk).extra == {"service_tier": "default"}
    renderer = StreamRenderer(chat=True, include_usage=False)
    renderer.render(opened_of(chunk))
    out = json.loads(renderer.render(events[0])[6:])
    assert out["service_tier"] == "default"
    assert out["choices"][0]["delta"] == {"role": "assistant", "refusal": "I can't"}
    fold = Fold(chat=True)
    for event in [opened_of(chunk), *events, OtherDelta(0, {"refusal": " do that"}),
                  Finished(0, "stop")]:
        fold.add(event)
    assert fold.response()["choices"][0]["message"] == {
        "role": "assistant", "content": None, "refusal": "I can't do that"}


def test_an_error_chunk_is_a_failure_and_an_unfinished_fold_is_not_complete():
    assert events_of_chunk({"error": {"message": "boom", "code": "x"}}, chat=True) == [
        Failed(502, "boom", "x")]
    fold = Fold(chat=True)
    for event in [Opened("c", 1, "m"), TextDelta(0, "half")]:
        fold.add(event)
    assert not fold.complete
    fold.add(Finished(0, "stop"))
    assert fold.complete
    fold.add(Failed(502, "cut", "upstream_error"))
    assert not fold.complete


async def test_a_stream_ends_at_a_failure_without_done_and_closes_its_source():
    closed = []

    async def source():
        try:
            yield Opened("c", 1, "m")
            yield TextDelta(0, "a")
            yield Failed(502, "cut", "upstream_error")
            yield TextDelta(0, "never")
        finally:
            closed.append(True)

    raw = [r async for r in sse(source(), chat=False, include_usage=False)]
    assert DONE not in raw
    assert json.loads(raw[-1][6:])["error"]["code"] == "upstream_error"
    assert b"never" not in b"".join(raw) and closed == [True]


async def test_started_raises_before_the_first_event_and_keeps_it_after():
    async def failing():
        raise RuntimeError("refused")
        yield

    with pytest.raises(RuntimeError, match="refused"):
        await started(failing())

    async def two():
        yield Opened("c", 1, "m")
        yield Finished(0, "stop")

    events = await started(two())
    assert events is not None
    assert [e async for e in events] == [Opened("c", 1, "m"), Finished(0, "stop")]

    async def empty():
        return
        yield

    assert await started(empty()) is None
