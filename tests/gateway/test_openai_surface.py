"""The whole OpenAI chat surface through the gateway to upstreams, with the official client.

A recording OpenAI-compatible upstream on loopback answers with tool calls; the gateway fronts
it as a direct HTTP deployment and as a litellm one. Every field a client sends must arrive
intact (or be refused by name), and every tool-call delta must come back as the upstream sent
it, streamed or not, with usage metered as usual."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from gateway.app import create_app
from tests.gateway.support import (
    in_process,
    loopback_upstream,
    seed_tenant,
    settings,
    write_deployments,
)

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:litellm"),
              pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
CALLS = [{"id": "call_a1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_b2", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
USAGE = {"prompt_tokens": 31, "completion_tokens": 17, "total_tokens": 48}
CONVERSATION = [
    {"role": "developer", "content": "Use tools."},
    {"role": "user", "content": [
        {"type": "text", "text": "Weather here and in Oslo?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=",
                                            "detail": "low"}}]},
    {"role": "assistant", "content": None, "tool_calls": [CALLS[0]]},
    {"role": "tool", "tool_call_id": "call_a1", "content": "18C"},
]
# Everything an agent sends, OpenAI's own fields and a vendor extra the deployment lists.
FIELDS: dict[str, Any] = {
    "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True,
    "response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "strict": True,
        "schema": {"type": "object", "properties": {"text": {"type": "string"}}}}},
    "logit_bias": {"1734": -100, "50256": 5}, "temperature": 0.2, "top_p": 0.9, "seed": 11,
    "max_completion_tokens": 64, "stop": ["\n\n"], "presence_penalty": 0.1,
    "frequency_penalty": 0.2, "metadata": {"run": "r1"}, "reasoning_effort": "low",
    "service_tier": "auto",
}
VENDOR = {"vendor_knob": {"level": 3}}


def stream_chunks() -> list[dict[str, Any]]:
    """OpenAI's own stream of two parallel calls: ids and names first, arguments in pieces."""
    head = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1,
            "model": "up-model"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": None})]
    for i, call in enumerate(CALLS):
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": "get_weather",
                                                       "arguments": ""}}]}))
        args = call["function"]["arguments"]
        for piece in (args[:5], args[5:11], args[11:]):
            out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
    out.append(chunk({}, "tool_calls"))
    out.append({**head, "choices": [], "usage": USAGE})
    return out


@dataclass
class Recorder:
    """An OpenAI-compatible upstream that keeps every body and answers with two tool calls."""

    base_url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if not body.get("stream"):
            return web.json_response({
                "id": "chatcmpl-up", "object": "chat.completion", "created": 1,
                "model": "up-model", "usage": USAGE,
                "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                             "message": {"role": "assistant", "content": None,
                                         "tool_calls": CALLS}}]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in stream_chunks():
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()
    async with loopback_upstream(rec.handle) as rec.base_url:
        yield rec


def upstreams(base_url: str) -> list[dict[str, Any]]:
    common = {"base_url": base_url, "api_key": "sk-up", "input_price_per_1m": "1",
              "output_price_per_1m": "2", "capabilities": {"images": True},
              "passthrough_fields": ["vendor_knob"]}
    return [
        {"name": "direct", "model_name": "via-http", "provider": "openai",
         "upstream_model": "up-model", **common},
        {"name": "lite", "model_name": "via-litellm", "provider": "litellm",
         "upstream_model": "openai/up-model", **common},
        {"name": "plain", "model_name": "no-extras", "provider": "openai",
         "upstream_model": "up-model", "base_url": base_url},
        {"name": "folding", "model_name": "via-stream", "provider": "openai",
         "upstream_model": "up-model", "stream_whole_answers": True, **common},
    ]


@dataclass
class World:
    client: openai.AsyncOpenAI
    recorder: Recorder
    usage: Any
    settled: Any


@pytest.fixture
async def world(sqlite_url: str, tmp_path: Path, recorder: Recorder) -> AsyncIterator[World]:
    cfg = settings(sqlite_url, tmp_path,
                   deployments_file=write_deployments(tmp_path, upstreams(recorder.base_url)))
    tenant = await seed_tenant(sqlite_url, tmp_path, name="agents")
    app = create_app(cfg)
    async with in_process(app) as http:
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=tenant.key,
                                    http_client=http, max_retries=0)

        async def usage() -> dict[str, Any]:
            await asyncio.gather(*app.state.gateway.background)
            await app.state.gateway.meter.flush()
            r = await http.get("/v1/usage/records",
                               headers={"authorization": f"Bearer {tenant.key}"})
            assert r.status_code == 200, r.text
            return r.json()

        async def settled() -> None:
            await asyncio.gather(*app.state.gateway.background)

        yield World(client, recorder, usage, settled)


def sent_as(body: dict[str, Any]) -> dict[str, Any]:
    """What the upstream should see of `body`: the same, with JSON's own spellings."""
    return json.loads(json.dumps(body))


async def calls_came_back_and_were_metered(world: World, reply: Any) -> None:
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.model_dump() for c in choice.message.tool_calls] == CALLS
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (31, 17)
    records = (await world.usage())["data"]
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in records] == [(31, 17)]


@pytest.mark.parametrize("model", ["via-http", "via-litellm"])
async def test_every_field_arrives_and_the_calls_come_back_intact(world, model):
    reply = await world.client.chat.completions.create(
        model=model, messages=CONVERSATION, extra_body=VENDOR, **FIELDS)
    seen = world.recorder.bodies[-1]
    assert seen["model"] == "up-model"
    for name, value in {**FIELDS, **VENDOR, "messages": CONVERSATION}.items():
        expected = sent_as(value)
        if name == "messages":  # an assistant message with calls may omit a null content
            seen_messages = [{k: v for k, v in m.items() if v is not None} for m in seen[name]]
            expected = [{k: v for k, v in m.items() if v is not None} for m in expected]
            if model == "via-litellm":  # litellm sends `developer` as `system` to models
                expected[0]["role"] = "system"  # outside its catalog
            assert seen_messages == expected
        else:
            assert seen[name] == expected, name
    await calls_came_back_and_were_metered(world, reply)


@pytest.mark.parametrize("model", ["via-http", "via-litellm"])
async def test_streamed_tool_call_deltas_come_back_as_sent(world, model):
    stream = await world.client.chat.completions.create(
        model=model, messages=CONVERSATION, tools=[WEATHER], stream=True,
        stream_options={"include_usage": True})
    got = [chunk async for chunk in stream]
    sent = stream_chunks()
    deltas = [[c.delta.model_dump(exclude_none=True) for c in chunk.choices] for chunk in got]
    expected = [[{k: v for k, v in c["delta"].items() if v is not None}
                 for c in chunk["choices"]] for chunk in sent]
    # litellm drops the first, empty delta; the tool-call deltas are the ones that matter.
    calls = [d for d in deltas if d and "tool_calls" in d[0]]
    assert calls == [d for d in expected if d and "tool_calls" in d[0]]
    assert [c.choices[0].finish_reason for c in got if c.choices][-1] == "tool_calls"
    assert got[-1].usage.completion_tokens == 17
    assert world.recorder.bodies[-1]["tools"] == [WEATHER]
    records = (await world.usage())["data"]
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in records] == [(31, 17)]


async def test_a_whole_answer_asked_as_a_stream_is_folded_back_whole(world):
    """`stream_whole_answers`: the upstream streams (its first event ends the routing
    deadline), the client gets the one response the events add up to."""
    reply = await world.client.chat.completions.create(
        model="via-stream", messages=CONVERSATION, tools=[WEATHER], logprobs=False)
    seen = world.recorder.bodies[-1]
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    await calls_came_back_and_were_metered(world, reply)


async def test_what_a_deployment_cannot_take_is_refused_by_name(world):
    before = len(world.recorder.bodies)
    cases = [
        ({"extra_body": {"vendor_knob": 1}}, "vendor_knob"),  # not in its passthrough list
        ({"extra_body": {"api_base": "http://elsewhere"}}, "api_base"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await world.client.chat.completions.create(
                model="no-extras", messages=[{"role": "user", "content": "hi"}], **extra)
        error = info.value.body
        assert (error["param"], error["code"]) == (param, "unsupported_parameter")
        assert "plain" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await world.client.chat.completions.create(model="no-extras", messages=CONVERSATION)
    assert info.value.body["param"] == "messages.1.content.1"
    assert "does not support images" in info.value.body["message"]
    assert len(world.recorder.bodies) == before  # nothing was sent upstream


def fold_calls(chunks: list[Any]) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "type": "function",
                                                      "function": {"name": None,
                                                                   "arguments": ""}})
                call["id"] = piece.id or call["id"]
                if piece.function is not None:
                    call["function"]["name"] = piece.function.name or call["function"]["name"]
                    call["function"]["arguments"] += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


async def test_cached_tool_calls_replay_whole_streamed_or_not(world):
    """A deterministic tool-call answer is cached with its calls: a stream is assembled with
    them, and a hit gives them back in either shape."""
    ask = {"model": "via-http", "messages": [{"role": "user", "content": "weather?"}],
           "tools": [WEATHER], "temperature": 0}
    live = await world.client.chat.completions.create(**ask, stream=True)
    assert fold_calls([c async for c in live]) == CALLS
    await world.settled()
    upstream_calls = len(world.recorder.bodies)
    raw = await world.client.chat.completions.with_raw_response.create(**ask)
    assert raw.headers["x-cache"] == "hit"
    reply = raw.parse()
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [c.model_dump() for c in reply.choices[0].message.tool_calls] == CALLS
    replayed = await world.client.chat.completions.create(**ask, stream=True)
    chunks = [c async for c in replayed]
    assert fold_calls(chunks) == CALLS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert len(world.recorder.bodies) == upstream_calls  # both answered from the cache
