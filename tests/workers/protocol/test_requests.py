"""Tool-call history in chat requests, checked as OpenAI checks it: every `tool` message
answers a call id of the most recent assistant message with `tool_calls`, and follows it
(several tool messages in a row may). Both the gateway and the worker server parse bodies
with these models, so both answer the same 400."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.requests import Request

from workers.engine.sampling_params import InvalidRequestError
from workers.protocol.requests import RequestError, parse_request
from workers.server.http import request_body


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


USER = {"role": "user", "content": "Weather in Paris and Oslo?"}
ASKS_TWO = {"role": "assistant", "content": None, "tool_calls": [_call("call_a"), _call("call_b")]}


def _tool(call_id: str, content: str = "18C") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _body(messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages}).encode()


def _refused(messages: list[dict[str, Any]]) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(_body(messages), chat=True)
    assert info.value.code == "invalid_value"
    return info.value


@pytest.mark.parametrize("messages", [
    [USER, ASKS_TWO, _tool("call_a")],
    [USER, ASKS_TWO, _tool("call_a"), _tool("call_b")],  # several in a row
    [USER, ASKS_TWO, _tool("call_b"), _tool("call_a")],  # in any order
    # a second round: the later assistant message's calls are the ones answered
    [USER, ASKS_TWO, _tool("call_a"), _tool("call_b"),
     {"role": "assistant", "content": None, "tool_calls": [_call("call_c")]}, _tool("call_c")],
    # a finished round, then plain turns
    [USER, ASKS_TWO, _tool("call_a"), _tool("call_b"),
     {"role": "assistant", "content": "18C in both."}, {"role": "user", "content": "Thanks"}],
    [USER],
], ids=["one", "two-in-a-row", "any-order", "second-round", "then-words", "no-tools"])
def test_a_valid_history_is_accepted(messages):
    request = parse_request(_body(messages), chat=True)
    assert [m.role for m in request.messages] == [m["role"] for m in messages]


@pytest.mark.parametrize(("messages", "index"), [
    ([USER, _tool("call_a")], 1),  # no assistant message at all
    ([_tool("call_a")], 0),  # the first message
    ([USER, {"role": "assistant", "content": "Let me see."}, _tool("call_a")], 2),
    # the assistant's calls were answered, then a user turn: the round is over
    ([USER, ASKS_TWO, _tool("call_a"), USER, _tool("call_b")], 4),
    # a later assistant message in words closes the earlier round
    ([USER, ASKS_TWO, _tool("call_a"), {"role": "assistant", "content": "Hmm."},
      _tool("call_b")], 4),
], ids=["no-assistant", "first", "assistant-without-calls", "after-a-user-turn",
        "after-a-plain-assistant"])
def test_a_tool_message_without_a_call_before_it_is_refused(messages, index):
    error = _refused(messages)
    assert error.param == f"messages.{index}.role"
    assert "must answer a preceding assistant message with 'tool_calls'" in str(error)


@pytest.mark.parametrize(("messages", "index", "unknown"), [
    ([USER, ASKS_TWO, _tool("call_zzz")], 2, "call_zzz"),
    ([USER, ASKS_TWO, _tool("call_a"), _tool("call_nope")], 3, "call_nope"),
    # an id of an earlier round does not answer the latest assistant message
    ([USER, ASKS_TWO, _tool("call_a"), _tool("call_b"),
      {"role": "assistant", "content": None, "tool_calls": [_call("call_c")]},
      _tool("call_a")], 5, "call_a"),
], ids=["unknown", "second-unknown", "earlier-round"])
def test_a_tool_message_answering_an_unknown_id_is_refused(messages, index, unknown):
    error = _refused(messages)
    assert error.param == f"messages.{index}.tool_call_id"
    assert f"'{unknown}' is not the id of any of the 'tool_calls'" in str(error)
    assert str(error).startswith(f"Invalid value for 'messages.{index}.tool_call_id': ")


def _worker_request(raw: bytes) -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                    "headers": []}, receive)


def test_the_worker_server_refuses_the_same_history():
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(request_body(_worker_request(_body([USER, _tool("call_a")])), chat=True))
    assert info.value.param == "messages.1.role"
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(request_body(_worker_request(
            _body([USER, ASKS_TWO, _tool("call_x")])), chat=True))
    assert info.value.param == "messages.2.tool_call_id"
    body = asyncio.run(request_body(_worker_request(_body([USER, ASKS_TWO, _tool("call_b")])),
                                    chat=True))
    assert body["messages"][-1]["tool_call_id"] == "call_b"
