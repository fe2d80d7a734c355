"""litellm deployments: against the mock upstream directly, and through the whole gateway.

The mock speaks OpenAI's API, so litellm's "openai/..." provider drives it over real HTTP: what
is checked is what litellm sends (the server-side key, only sampling fields), what the gateway
gets back (OpenAI's shapes, the usage it bills), and how litellm's failures are mapped for the
router. A small scripted upstream in the test's own loop answers what the mock cannot (429 with
retry-after, context errors, a stream cut midway)."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.app import create_app
from gateway.deployments.base import AdapterRef, Call, UpstreamFailure
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.external import LiteLLMDeployment, load_litellm
from gateway.errors import APIError
from gateway.routing.fallback import answer
from tests.gateway.support import (
    MockUpstream,
    assert_error,
    bearer,
    free_port,
    in_process,
    loopback_upstream,
    ok,
    seed_tenant,
    settings,
    write_deployments,
)
from workers.protocol.events import TextDelta
from workers.protocol.render import Fold, sse
from workers.protocol.requests import ChatCompletionRequest, CompletionRequest, OpenAIRequest

# litellm's own deprecation noise, not ours.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:litellm"),
              pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning")]

KEY = "sk-upstream-secret"
REPLY = "Hello from the mock upstream."
MESSAGES = [{"role": "user", "content": "Say hello"}]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def failing() -> Iterator[MockUpstream]:
    upstream = MockUpstream("--fail-rate", "1.0").start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def slow() -> Iterator[MockUpstream]:
    upstream = MockUpstream("--delay-ms", "3000").start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def keyed() -> Iterator[MockUpstream]:
    upstream = MockUpstream("--require-key", KEY).start()
    yield upstream
    upstream.stop()


@dataclass
class Scripted:
    """An upstream in the test's loop that answers whatever the test sets in `answer`."""

    base_url: str = ""
    answer: dict[str, Any] = field(default_factory=dict)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    requests: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        a = self.answer
        if "events" not in a:
            return web.json_response(a.get("json", {}), status=a.get("status", 200),
                                     headers=a.get("headers"))
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(a.get("repeat", 1)):
                for event in a["events"]:
                    await resp.write(b"data: " + json.dumps({**event, "id": f"x{i}"}).encode()
                                     + b"\n\n")
                    await asyncio.sleep(a.get("gap_s", 0))
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        if a.get("cut"):  # the connection drops with the stream half sent
            assert request.transport is not None
            request.transport.close()
            return resp
        if a.get("done", True):
            await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    s = Scripted()
    async with loopback_upstream(s.handle) as s.base_url:
        yield s


def deployment(base_url: str | None, **overrides: Any) -> LiteLLMDeployment:
    values: dict[str, Any] = {
        "name": "ext", "model_name": "ext-model", "provider": "litellm",
        "upstream_model": "openai/mock-model", "base_url": base_url, "api_key": KEY,
        "input_price_per_1m": "1.0", "output_price_per_1m": "2.0", **overrides,
    }
    return LiteLLMDeployment(DeploymentConfig.model_validate(values))


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "ext-model", "messages": MESSAGES,
                                                 **body})


def text(**body: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "ext-model", "prompt": "Say", **body})


def prepared(d: LiteLLMDeployment, request: OpenAIRequest) -> Call:
    return d.prepare(request, chat=isinstance(request, ChatCompletionRequest), tenant_id="t1")


async def events_of(d: LiteLLMDeployment, call: Call) -> list[bytes]:
    """The SSE the gateway renders of the deployment's events."""
    return [e async for e in sse(d.open(call, request_id="req-s"), chat=call.chat,
                                 include_usage=call.request.include_usage)]


async def whole(d: LiteLLMDeployment, call: Call, request_id: str) -> dict[str, Any]:
    """A non-streamed answer as the router gets it: the first event, then the fold."""
    folded = await answer(d, call, stream=False, request_id=request_id,
                          answering=lambda: None)
    assert isinstance(folded, Fold)
    return folded.response()


def parsed(events: list[bytes]) -> list[dict[str, Any]]:
    for e in events:
        assert e.startswith(b"data: ") and e.endswith(b"\n\n"), e
    return [json.loads(e[6:]) for e in events if e != b"data: [DONE]\n\n"]


def stats(upstream: MockUpstream) -> dict[str, Any]:
    return httpx.get(f"http://127.0.0.1:{upstream.port}/_stats").json()


# ----------------------------------------------------------------------------- direct calls


async def test_chat_completion(mock_upstream):
    d = deployment(mock_upstream.base_url)
    call = prepared(d, chat(max_tokens=3, temperature=0.5, seed=7))
    body = await whole(d, call, request_id="req-1")
    assert body["object"] == "chat.completion"
    assert body["model"] == "ext-model"  # the client's name, not the upstream's
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello from the"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert "provider_specific_fields" not in json.dumps(body)
    assert (call.usage.completion_tokens, call.usage.finished) == (3, True)
    assert call.usage.prompt_tokens == body["usage"]["prompt_tokens"] > 0
    assert call.upstream_s > 0
    seen = mock_upstream.last_request()
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["authorization"] == f"Bearer {KEY}"
    assert seen["headers"]["x-request-id"] == "req-1"
    assert seen["body"] == {"model": "mock-model", "messages": MESSAGES, "max_tokens": 3,
                            "temperature": 0.5, "seed": 7}


async def test_user_reaches_a_model_outside_litellms_catalog(mock_upstream):
    """litellm drops `user` for a model its catalog lacks ("mock-model"): sent in the body."""
    d = deployment(mock_upstream.base_url)
    await d.start()
    try:
        call = prepared(d, chat(max_tokens=2, user="end-user-7"))
        await whole(d, call, request_id="req-user")
    finally:
        await d.close()
    assert mock_upstream.last_request()["body"]["user"] == "end-user-7"


async def test_text_completion(mock_upstream):
    d = deployment(mock_upstream.base_url)
    call = prepared(d, text(max_tokens=50))
    body = await whole(d, call, request_id="req-2")
    assert body["object"] == "text_completion" and body["model"] == "ext-model"
    assert body["choices"][0]["text"] == REPLY
    assert (call.usage.completion_tokens, call.usage.finished) == (5, True)
    seen = mock_upstream.last_request()
    assert seen["path"] == "/v1/completions"
    assert seen["body"] == {"model": "mock-model", "prompt": "Say", "max_tokens": 50,
                            "stream": False}


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_stream(mock_upstream, include_usage):
    d = deployment(mock_upstream.base_url)
    call = prepared(d, chat(stream=True, stream_options={"include_usage": include_usage}))
    events = await events_of(d, call)
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = parsed(events)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "ext-model"
               for c in chunks)
    content = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert "".join(content) == REPLY
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    usage_events = [c for c in chunks if c.get("usage") is not None]
    if include_usage:  # OpenAI's shape: the last chunk, no choices; `usage: null` before
        assert usage_events == [chunks[-1]] and chunks[-1]["choices"] == []
        assert all("usage" in c for c in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == 5
    else:
        assert usage_events == [] and not any("usage" in c for c in chunks)
    # The upstream is always asked for usage, so the real count settles either way.
    sent = mock_upstream.last_request()["body"]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert (call.usage.completion_tokens, call.usage.finished) == (5, True)
    assert call.usage.prompt_tokens > 0


async def test_text_stream(mock_upstream):
    d = deployment(mock_upstream.base_url)
    call = prepared(d, text(stream=True, stream_options={"include_usage": True}))
    events = await events_of(d, call)
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = parsed(events)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == REPLY
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert mock_upstream.last_request()["path"] == "/v1/completions"
    assert (call.usage.completion_tokens, call.usage.finished) == (5, True)


class Smuggling(ChatCompletionRequest):
    """A request model that forwards connection settings, as a careless schema change might."""

    def upstream_body(self) -> dict[str, Any]:
        return {**super().upstream_body(), "api_base": "http://127.0.0.1:9/v1",
                "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-caller",
                "extra_headers": {"authorization": "Bearer sk-caller"},
                "mock_response": "pwned", "custom_llm_provider": "anthropic"}


async def test_the_caller_cannot_redirect_or_rekey(keyed):
    extras = {"api_base": "http://127.0.0.1:9/v1", "base_url": "http://127.0.0.1:9/v1",
              "api_key": "sk-caller", "extra_headers": {"x-a": "1"}, "mock_response": "pwned"}
    # Unknown fields are kept aside, never mixed into the known ones; routing refuses them
    # unless the deployment lists them (tests/gateway/test_openai_surface.py) ...
    request = chat(**extras)
    assert request.extra_fields() == sorted(extras)
    # ... and even a deployment that forwards them all hands them to litellm inside the
    # request body, never as arguments that choose where or how it connects.
    d = deployment(keyed.base_url, passthrough_fields=sorted(extras))
    smuggled = Smuggling.model_validate({"model": "ext-model", "messages": MESSAGES})
    for req in (request, smuggled):
        call = prepared(d, req)
        body = await whole(d, call, request_id="req-3")
        assert body["choices"][0]["message"]["content"] == REPLY  # the real upstream answered
        seen = keyed.last_request()
        assert seen["headers"]["authorization"] == f"Bearer {KEY}"
        assert "x-a" not in seen["headers"]
    assert set(seen["body"]) == {"model", "messages"}  # Smuggling's fields went nowhere


def test_prepare_estimates_and_refuses_overflow(mock_upstream):
    d = deployment(mock_upstream.base_url, context_window=64)
    call = prepared(d, chat(max_tokens=5, n=2))
    assert call.max_output_tokens == 10 and 0 < call.prompt_tokens < 64
    with pytest.raises(APIError) as err:
        prepared(d, chat(messages=[{"role": "user", "content": "word " * 100}]))
    assert (err.value.status, err.value.code) == (400, "context_length_exceeded")
    with pytest.raises(APIError) as err:
        d.prepare(chat(), chat=True, tenant_id="t1", adapter=AdapterRef("a", "t1/a", "/x"))
    assert err.value.status == 404


# ----------------------------------------------------------------------------- pricing


async def test_prices_from_litellms_cost_map_and_config_wins(mock_upstream, caplog):
    entry = load_litellm().model_cost["gpt-4o-mini"]
    mapped = deployment(mock_upstream.base_url, upstream_model="openai/gpt-4o-mini",
                        input_price_per_1m=None, output_price_per_1m=None)
    configured = deployment(mock_upstream.base_url, upstream_model="openai/gpt-4o-mini",
                            input_price_per_1m="9", output_price_per_1m=None)
    unknown = deployment(mock_upstream.base_url, input_price_per_1m=None,
                         output_price_per_1m=None)
    try:
        await mapped.start()
        await configured.start()
        with caplog.at_level(logging.WARNING, logger="gateway.deployments.external"):
            await unknown.start()
    finally:
        for d in (mapped, configured, unknown):
            await d.close()
    price = mapped.price
    assert price.source == "litellm"
    assert price.input_per_1m == Decimal(str(entry["input_cost_per_token"])) * 10**6
    assert price.output_per_1m == Decimal(str(entry["output_cost_per_token"])) * 10**6
    assert (price.input_per_1m, price.output_per_1m) == (Decimal("0.15"), Decimal("0.6"))
    assert price.cost_micros(1_000_000, 1_000_000) == 750_000
    assert (configured.price.source, configured.price.input_per_1m,
            configured.price.output_per_1m) == ("config", Decimal(9), Decimal(0))
    assert (unknown.price.source, unknown.price.per_1m) == ("none", 0)
    assert "no price for 'openai/mock-model'" in caplog.text


async def test_start_refuses_a_model_string_without_provider(mock_upstream):
    d = deployment(None, upstream_model="no-such-model-xyz")
    with pytest.raises(APIError) as err:
        await d.start()
    assert (err.value.status, err.value.param) == (400, "upstream_model")


# ----------------------------------------------------------------------------- failures


async def upstream_failure(d: LiteLLMDeployment, *, stream: bool) -> UpstreamFailure:
    call = prepared(d, chat(stream=stream))
    with pytest.raises(UpstreamFailure) as err:
        if stream:
            await anext(d.open(call, request_id="req-f"))  # before the first chunk: raises
        else:
            await whole(d, call, request_id="req-f")
    return err.value


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_500_is_a_502_and_never_retried_by_litellm(failing, stream):
    before = stats(failing)["requests"]
    failure = await upstream_failure(deployment(failing.base_url), stream=stream)
    assert (failure.status, failure.code) == (502, "upstream_error")
    assert stats(failing)["requests"] == before + 1  # the router retries, not litellm


@pytest.mark.parametrize("stream", [False, True])
async def test_dead_port_is_unreachable(stream):
    base_url = f"http://127.0.0.1:{free_port()}/v1"
    failure = await upstream_failure(deployment(base_url), stream=stream)
    assert (failure.status, failure.code) == (502, "upstream_unreachable")
    assert "127.0.0.1" not in failure.message


@pytest.mark.parametrize("stream", [False, True])
async def test_slow_upstream_times_out(slow, stream):
    d = deployment(slow.base_url, timeout_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    failure = await upstream_failure(d, stream=stream)
    assert (failure.status, failure.code) == (504, "upstream_timeout")
    assert loop.time() - started < 2


async def test_refused_credentials(keyed):
    failure = await upstream_failure(deployment(keyed.base_url, api_key="sk-wrong"),
                                     stream=False)
    assert (failure.status, failure.code) == (502, "upstream_error")
    assert failure.message == "the upstream refused the gateway's credentials"


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_429_keeps_retry_after(scripted, stream):
    scripted.answer = {"status": 429, "headers": {"retry-after": "7"},
                       "json": {"error": {"message": "slow down", "type": "rate_limit"}}}
    failure = await upstream_failure(deployment(scripted.base_url), stream=stream)
    assert (failure.status, failure.code, failure.retry_after) == (
        429, "upstream_rate_limited", "7")
    assert scripted.requests == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_context_error_lets_the_router_fall_back(scripted, stream):
    scripted.answer = {"status": 400, "json": {"error": {
        "message": "This model's maximum context length is 16 tokens.",
        "type": "invalid_request_error", "param": "messages",
        "code": "context_length_exceeded"}}}
    d = deployment(scripted.base_url)
    call = prepared(d, chat(stream=stream))
    with pytest.raises(APIError) as err:
        if stream:
            await anext(d.open(call, request_id="req-c"))
        else:
            await whole(d, call, request_id="req-c")
    assert (err.value.status, err.value.code) == (400, "context_length_exceeded")
    assert err.value.message == "This model's maximum context length is 16 tokens."


async def test_other_client_errors_pass_through_without_secrets(scripted):
    leak = f"bad temperature for {scripted.base_url} with key {KEY}"
    d = deployment(scripted.base_url)
    for status in (400, 422):
        scripted.answer = {"status": status, "json": {"error": {
            "message": leak, "type": "invalid_request_error", "code": None}}}
        with pytest.raises(APIError) as err:
            await whole(d, prepared(d, chat()), request_id="req-b")
        assert (err.value.status, err.value.code) == (status, "upstream_rejected")
        assert err.value.message.startswith("bad temperature for ")
        assert KEY not in err.value.message and "127.0.0.1" not in err.value.message
    scripted.answer = {"status": 404, "json": {"error": {"message": leak}}}
    failure = await upstream_failure(d, stream=False)
    assert (failure.status, failure.code) == (502, "upstream_error")
    assert KEY not in failure.message and "127.0.0.1" not in failure.message


CHUNK = {"object": "chat.completion.chunk", "created": 1, "model": "mock-model",
         "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}


@pytest.mark.parametrize("how", [
    {"cut": True},  # the connection drops
    {"done": False},  # the response ends cleanly, but with no finish and no [DONE]
    {"gap_s": 0.2, "timeout_s": 0.5},  # the deployment's deadline passes mid-stream
])
async def test_a_stream_that_fails_midway_ends_with_an_error_billing_what_came(scripted, how):
    timeout_s = how.pop("timeout_s", 30)
    scripted.answer = {"events": [CHUNK], "repeat": 4, **how}
    d = deployment(scripted.base_url, timeout_s=timeout_s)
    call = prepared(d, chat(stream=True))
    events = await events_of(d, call)
    *content, last = events
    assert content and b"[DONE]" not in last
    error = json.loads(last[len(b"data: "):])["error"]
    assert error["type"] == "server_error" and error["code"].startswith("upstream_")
    assert KEY not in error["message"] and "127.0.0.1" not in error["message"]
    assert 0 < len(parsed(content)) <= 4
    assert (call.usage.completion_tokens, call.usage.finished) == (len(content), False)


async def test_closing_the_stream_early_closes_the_upstream(scripted):
    scripted.answer = {"events": [CHUNK], "repeat": 500, "gap_s": 0.01}
    d = deployment(scripted.base_url)
    events = d.open(prepared(d, chat(stream=True)), request_id="req-d")
    await anext(events)  # opened
    assert await anext(events) == TextDelta(0, "tok")
    await events.aclose()  # type: ignore[attr-defined]
    await asyncio.wait_for(scripted.disconnected.wait(), 3)


# ----------------------------------------------------------------------------- the whole gateway


def yaml_deployment(base_url: str, **overrides: Any) -> dict[str, Any]:
    return {"name": "ext", "model_name": "ext-model", "provider": "litellm",
            "upstream_model": "openai/mock-model", "base_url": base_url, "api_key": KEY,
            "input_price_per_1m": "1.0", "output_price_per_1m": "2.0",
            "context_window": 4096, **overrides}


async def test_through_the_gateway(sqlite_url, tmp_path: Path, mock_upstream):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="ext", plan={"rpm": 1000})
    cfg = settings(sqlite_url, tmp_path, deployments_file=write_deployments(
        tmp_path, [yaml_deployment(mock_upstream.base_url)]))
    app = create_app(cfg)
    async with in_process(app) as gw:
        gw.headers.update(bearer(tenant.key))
        refused = await gw.post("/v1/chat/completions", json={
            "model": "ext-model", "messages": MESSAGES, "max_tokens": 4,
            "api_base": "http://127.0.0.1:9/v1", "api_key": "sk-caller"})
        assert_error(refused, 400, code="unsupported_parameter")
        body = ok(await gw.post("/v1/chat/completions", json={
            "model": "ext-model", "messages": MESSAGES, "max_tokens": 4}))
        assert body["model"] == "ext-model"
        assert body["choices"][0]["message"]["content"] == "Hello from the mock"
        seen = mock_upstream.last_request()
        assert seen["headers"]["authorization"] == f"Bearer {KEY}"
        assert tenant.key not in json.dumps(seen) and "sk-caller" not in json.dumps(seen)
        assert set(seen["body"]) == {"model", "messages", "max_tokens"}

        r = await gw.post("/v1/completions", json={"model": "ext-model", "prompt": "Say"})
        assert ok(r)["choices"][0]["text"] == REPLY

        async with gw.stream("POST", "/v1/chat/completions", json={
                "model": "ext-model", "messages": MESSAGES, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([part async for part in r.aiter_bytes()])
        events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]\n\n"
        chunks = parsed(events)
        assert "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks if c["choices"]) == REPLY
        streamed_usage = chunks[-1]["usage"]

        await app.state.gateway.meter.flush()
        report = ok(await gw.get("/v1/usage"))
    (row,) = report["models"]
    assert row["model"] == "ext-model" and row["requests"] == 3
    assert row["completion_tokens"] == 4 + 5 + streamed_usage["completion_tokens"]
    # 1 USD per 1M input tokens, 2 per 1M output: exactly micro-USD per token.
    assert row["cost_micros"] == row["prompt_tokens"] + 2 * row["completion_tokens"]


async def test_failures_through_the_gateway(sqlite_url, tmp_path: Path, scripted):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="ext", plan={"rpm": 1000})
    dead = f"http://127.0.0.1:{free_port()}/v1"
    cfg = settings(sqlite_url, tmp_path, deployments_file=write_deployments(tmp_path, [
        yaml_deployment(dead, name="dead", model_name="dead-model"),
        yaml_deployment(scripted.base_url, name="limited", model_name="limited-model"),
    ]))
    scripted.answer = {"status": 429, "headers": {"retry-after": "7"},
                       "json": {"error": {"message": "slow down", "type": "rate_limit"}}}
    async with in_process(create_app(cfg)) as gw:
        gw.headers.update(bearer(tenant.key))
        r = await gw.post("/v1/chat/completions", json={"model": "dead-model",
                                                        "messages": MESSAGES})
        error = assert_error(r, 502, code="upstream_unreachable")
        assert "127.0.0.1" not in error["message"] and KEY not in r.text
        r = await gw.post("/v1/chat/completions", json={"model": "limited-model",
                                                        "messages": MESSAGES, "stream": True})
        assert_error(r, 429, code="upstream_rate_limited")
        assert r.headers["retry-after"] == "7"
