"""Responses and Messages passed through natively: the official `openai` and `anthropic` SDKs
against a live gateway on loopback whose upstreams are mocks that record what they get.

An `openai` deployment with `native_apis: [responses, messages]` is sent /v1/responses and
/v1/messages (the upstream model, `store: false`, the conversation expanded, never
`previous_response_id`); a litellm `anthropic` provider is sent /v1/messages natively; a
deployment without native APIs still gets /v1/chat/completions. Whatever the upstream, the
client sees the gateway's own rendering, errors in its surface's shape, and the usage billed
is the upstream's own count."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic._constants import ANTHROPIC_API_VERSION as SDK_VERSION

from bench.common.mock_native import TOOL_ARGUMENTS
from bench.common.mock_upstream import DEFAULT_REPLY, MockServerThread, count_tokens
from gateway.app import create_app
from tenancy import stored_responses
from tests.gateway.support import (
    Seeded,
    live,
    seed_tenant,
    settings,
    usage_rows,
    write_deployments,
)

# litellm's own deprecation noise, not ours.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:litellm"),
              pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning")]

MOCKS = ("native", "chat")
KEY = "sk-native-upstream-secret"
WEATHER = {"type": "function", "name": "weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
ANTHROPIC_WEATHER = {"name": "weather", "description": "Weather now",
                     "input_schema": WEATHER["parameters"]}


def deployments(mocks: dict[str, MockServerThread]) -> list[dict[str, Any]]:
    common = {"provider": "openai", "api_key": KEY, "input_price_per_1m": "1",
              "output_price_per_1m": "2", "context_window": 4096}
    return [
        {**common, "name": "native", "model_name": "native", "upstream_model": "up-native",
         "base_url": mocks["native"].base_url, "native_apis": ["responses", "messages"]},
        {**common, "name": "plain", "model_name": "plain", "upstream_model": "up-plain",
         "base_url": mocks["chat"].base_url},
        # Anthropic's base URL has no /v1: litellm's provider config adds /v1/messages.
        {**common, "name": "claude", "model_name": "claude", "provider": "litellm",
         "upstream_model": "anthropic/claude-up", "base_url": mocks["native"].url},
    ]


@dataclass
class Served:
    port: int
    tenant: Seeded
    other: Seeded
    mocks: dict[str, MockServerThread]
    db_url: str

    def openai(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1",
                                  api_key=key or self.tenant.key, max_retries=0)

    def anthropic(self) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{self.port}",
                                        api_key=self.tenant.key, max_retries=0)

    def got(self, name: str = "native") -> dict[str, Any]:
        """What the mock upstream `name` last received (path, headers, body)."""
        last = self.mocks[name].mock.last_request
        assert last is not None, f"the {name} upstream got nothing"
        return last


@pytest.fixture
async def served(sqlite_url, tmp_path, mocks, monkeypatch) -> AsyncIterator[Served]:
    monkeypatch.setattr(stored_responses, "FRESH_S", 0.2)
    tenant = await seed_tenant(sqlite_url, tmp_path, name="acme", plan={"rpm": 1000})
    other = await seed_tenant(sqlite_url, tmp_path, name="other", plan={"rpm": 1000})
    cfg = settings(sqlite_url, tmp_path,
                   deployments_file=write_deployments(tmp_path, deployments(mocks)))
    with live(cfg, create_app(cfg)) as port:
        yield Served(port, tenant, other, mocks, sqlite_url)


def mock_tokens(text: str) -> int:
    return count_tokens(text)


# ---- Responses --------------------------------------------------------------------------------

async def test_responses_go_to_the_upstreams_responses_with_its_model_and_store_off(served):
    async with served.openai() as sdk:
        raw = await sdk.responses.with_raw_response.create(
            model="native", input="Say hello", instructions="Be brief.", metadata={"k": "v"},
            max_output_tokens=50)
        response = raw.parse()
    assert response.id.startswith("resp_") and response.status == "completed"
    assert response.output_text == DEFAULT_REPLY and response.metadata == {"k": "v"}
    got = served.got()
    assert got["path"] == "/v1/responses"
    assert got["headers"]["authorization"] == f"Bearer {KEY}"
    body = got["body"]
    assert body["model"] == "up-native" and body["store"] is False
    assert body["stream"] is False and body["instructions"] == "Be brief."
    assert body["max_output_tokens"] == 50
    assert "previous_response_id" not in body and "metadata" not in body
    assert body["input"] == [{"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": "Say hello"}]}]
    # the usage billed and shown is the upstream's own count
    prompt = mock_tokens("Be brief. Say hello")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (prompt, 5)
    (record,) = await usage_rows(served.db_url, [raw.headers["x-request-id"]])
    assert (record.prompt_tokens, record.completion_tokens, record.deployment) == (
        prompt, 5, "native")
    assert served.mocks["chat"].mock.stats.requests == 0


async def test_a_streamed_response_is_rendered_by_the_gateway(served):
    async with served.openai() as sdk, sdk.responses.stream(model="native",
                                                            input="Say hello") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert final.output_text == DEFAULT_REPLY and final.id.startswith("resp_")
    assert final.usage.input_tokens == mock_tokens("Say hello")
    body = served.got()["body"]
    assert body["stream"] is True and body["store"] is False


async def test_a_function_call_whole_and_streamed(served):
    async with served.openai() as sdk:
        whole = await sdk.responses.create(model="native", input="Weather in Paris?",
                                           tools=[WEATHER])
        async with sdk.responses.stream(model="native", input="And in Rome?",
                                        tools=[WEATHER]) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_response()
    assert served.got()["body"]["tools"] == [WEATHER]
    for response in (whole, streamed):
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert call.name == "weather" and json.loads(call.arguments) == TOOL_ARGUMENTS
        assert call.call_id.startswith("call_mock") and response.status == "completed"
    assert "response.function_call_arguments.delta" in kinds


async def test_a_continuation_sends_the_conversation_and_is_the_tenants_own(served):
    async with served.openai() as sdk, served.openai(served.other.key) as theirs:
        first = await sdk.responses.create(model="native", input="Weather in Paris?",
                                           tools=[WEATHER])
        (call,) = [item for item in first.output if item.type == "function_call"]
        second = await sdk.responses.create(
            model="native", previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "18C"}])
        assert second.previous_response_id == first.id and second.output_text == DEFAULT_REPLY
        body = served.got()["body"]
        assert "previous_response_id" not in body and body["store"] is False
        assert [item["type"] for item in body["input"]] == [
            "message", "function_call", "function_call_output"]
        assert body["input"][1] == {"type": "function_call", "call_id": call.call_id,
                                    "name": "weather", "arguments": call.arguments}
        assert body["input"][2]["output"] == "18C"
        assert all("id" not in item for item in body["input"])  # the gateway's own ids
        requests = served.mocks["native"].mock.stats.requests
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.create(model="native", input="more",
                                          previous_response_id=first.id)
        assert served.mocks["native"].mock.stats.requests == requests  # never sent


@pytest.mark.parametrize(("status", "error"), [(400, openai.BadRequestError),
                                               (500, openai.InternalServerError)])
async def test_upstream_errors_take_openais_shape(served, status, error):
    served.mocks["native"].mock.mode.status = status
    async with served.openai() as sdk:
        with pytest.raises(error) as caught:
            await sdk.responses.create(model="native", input="hi")
    assert caught.value.status_code == (400 if status == 400 else 502)
    assert set(caught.value.body) >= {"message", "type", "code"}
    assert KEY not in caught.value.message


# ---- Messages ---------------------------------------------------------------------------------

async def test_messages_go_to_the_upstreams_messages_as_validated(served):
    async with served.anthropic() as claude:
        raw = await claude.messages.with_raw_response.create(
            model="native", max_tokens=50, system="Be brief.", stop_sequences=["\n\n"],
            metadata={"user_id": "u-1"}, inference_geo="eu", extra_body={"temperature": 0.5},
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "Say hello", "cache_control": {"type": "ephemeral"}}]}])
        message = await raw.parse()
    assert message.content[0].text == DEFAULT_REPLY and message.stop_reason == "end_turn"
    assert message.id.startswith("msg_mock")  # the upstream's id
    got = served.got()  # the account's settings (inference_geo) are the deployment's
    assert got["path"] == "/v1/messages"
    assert got["headers"]["anthropic-version"] == SDK_VERSION  # the client's, forwarded
    assert got["headers"]["x-api-key"] == KEY
    assert got["body"] == {
        "model": "up-native", "stream": False, "max_tokens": 50, "system": "Be brief.",
        "temperature": 0.5, "metadata": {"user_id": "u-1"}, "stop_sequences": ["\n\n"],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Say hello", "cache_control": {"type": "ephemeral"}}]}]}
    prompt = mock_tokens("Be brief. Say hello")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (prompt, 5)
    (record,) = await usage_rows(served.db_url, [raw.headers["x-request-id"]])
    assert (record.prompt_tokens, record.completion_tokens) == (prompt, 5)


async def test_a_streamed_message_and_a_tool_call(served):
    async with served.anthropic() as claude:
        async with claude.messages.stream(
                model="native", max_tokens=2,
                messages=[{"role": "user", "content": "Say hello"}]) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "Hello from" and final.stop_reason == "max_tokens"
        assert final.usage.output_tokens == 2
        assert served.got()["body"]["stream"] is True
        called = await claude.messages.create(
            model="native", max_tokens=50, tools=[ANTHROPIC_WEATHER],
            messages=[{"role": "user", "content": "Weather in Paris?"}])
        async with claude.messages.stream(
                model="native", max_tokens=50, tools=[ANTHROPIC_WEATHER],
                messages=[{"role": "user", "content": "And in Rome?"}]) as stream:
            streamed = await stream.get_final_message()
    for message in (called, streamed):
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "weather"
        assert block.input == TOOL_ARGUMENTS and message.stop_reason == "tool_use"
    assert served.got()["body"]["tools"] == [ANTHROPIC_WEATHER]


@pytest.mark.parametrize(("status", "error"), [(400, anthropic.BadRequestError),
                                               (500, anthropic.InternalServerError)])
async def test_upstream_errors_take_anthropics_shape(served, status, error):
    served.mocks["native"].mock.mode.status = status
    async with served.anthropic() as claude:
        with pytest.raises(error) as caught:
            await claude.messages.create(model="native", max_tokens=5,
                                         messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == (400 if status == 400 else 502)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == (
        "invalid_request_error" if status == 400 else "api_error")


async def test_a_litellm_anthropic_provider_gets_messages_natively(served):
    async with served.anthropic() as claude:
        message = await claude.messages.create(
            model="claude", max_tokens=50, messages=[{"role": "user", "content": "Say hello"}])
        async with claude.messages.stream(
                model="claude", max_tokens=50, tools=[ANTHROPIC_WEATHER],
                messages=[{"role": "user", "content": "Weather?"}]) as stream:
            streamed = await stream.get_final_message()
    assert message.content[0].text == DEFAULT_REPLY
    assert message.usage.input_tokens == mock_tokens("Say hello")
    assert streamed.content[0].type == "tool_use"
    assert streamed.content[0].input == TOOL_ARGUMENTS
    got = served.got()  # sent by the gateway as validated (litellm's translation would
    # make the content blocks, and say so in its user-agent)
    assert got["path"] == "/v1/messages" and got["body"]["model"] == "claude-up"
    assert got["body"]["messages"] == [{"role": "user", "content": "Weather?"}]
    assert "litellm" not in got["headers"].get("user-agent", "")
    assert got["headers"]["x-api-key"] == KEY
    assert got["headers"]["anthropic-version"] == SDK_VERSION  # the client's, forwarded
    assert got["body"]["stream"] is True and got["body"]["tools"] == [ANTHROPIC_WEATHER]


# ---- the client's anthropic-version and anthropic-beta ----------------------------------------

BETAS = ("prompt-caching-2024-07-31", "token-efficient-tools-2025-02-19",
         "interleaved-thinking-2025-05-14")
HELLO = {"max_tokens": 20, "messages": [{"role": "user", "content": "Say hello"}]}


async def post_message(served: Served, model: str, headers: list[tuple[str, Any]]
                       ) -> httpx.Response:
    """POST /v1/messages with `headers` as given (a name may come several times)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.port}") as client:
        return await client.post("/v1/messages", json={"model": model, **HELLO}, headers=[
            ("x-api-key", served.tenant.key), *headers])


@pytest.mark.parametrize("model", ["native", "claude"])  # an openai and a litellm upstream
async def test_the_clients_version_and_betas_reach_a_native_upstream(served, model):
    response = await post_message(served, model, [
        ("anthropic-version", "2024-10-22"),
        ("anthropic-beta", f"{BETAS[0]}, {BETAS[1]}"),
        ("anthropic-beta", f"{BETAS[1]},{BETAS[2]}")])
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"] == DEFAULT_REPLY
    headers = served.got()["headers"]  # merged into one line, in order, each once
    assert headers["anthropic-beta"] == ",".join(BETAS)
    assert headers["anthropic-version"] == "2024-10-22"
    assert headers["x-api-key"] == KEY  # the deployment's key, as before
    response = await post_message(served, model, [])  # neither given: the default version
    assert response.status_code == 200, response.text
    headers = served.got()["headers"]
    assert headers["anthropic-version"] == "2023-06-01" and "anthropic-beta" not in headers


async def test_the_sdks_betas_reach_a_native_upstream(served):
    async with served.anthropic() as claude:
        message = await claude.beta.messages.create(model="native", betas=list(BETAS[:2]),
                                                    **HELLO)
        assert message.content[0].text == DEFAULT_REPLY
        headers = served.got()["headers"]
        assert headers["anthropic-beta"] == ",".join(BETAS[:2])
        assert headers["anthropic-version"] == SDK_VERSION
        async with claude.messages.stream(
                model="claude", extra_headers={"anthropic-beta": BETAS[2]}, **HELLO) as stream:
            assert (await stream.get_final_message()).content[0].text == DEFAULT_REPLY
        got = served.got()
        assert got["body"]["stream"] is True and got["headers"]["anthropic-beta"] == BETAS[2]
        await claude.messages.create(model="native", **HELLO)  # none asked: none sent
        assert "anthropic-beta" not in served.got()["headers"]


@pytest.mark.parametrize(("header", "values"), [
    ("anthropic-beta", ["prompt caching"]),
    ("anthropic-beta", ["a;b"]),
    ("anthropic-beta", ["x-api-key: sk-stolen"]),
    ("anthropic-beta", ["caf\u00e9".encode()]),
    ("anthropic-beta", [",".join(["token-efficient-tools-2025-02-19"] * 40)]),  # > 1 KiB
    ("anthropic-beta", ["a" * 600, "b" * 600]),  # > 1 KiB over both lines
    ("anthropic-version", ["2023-06-01, 2024-10-22"]),
    ("anthropic-version", ["2023-06-01", "2024-10-22"]),
    ("anthropic-version", [""]),
])
@pytest.mark.parametrize("model", ["native", "plain"])
async def test_a_bad_header_is_a_400_in_anthropics_shape_and_nothing_goes_upstream(
        served, model, header, values):
    response = await post_message(served, model, [(header, value) for value in values])
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(f"{header}:")
    assert "sk-stolen" not in response.text
    assert served.mocks["native"].mock.stats.requests == 0
    assert served.mocks["chat"].mock.stats.requests == 0


@pytest.mark.parametrize(("header", "values"), [
    ("anthropic-beta", ["a;b"]),
    ("anthropic-beta", ["x-api-key: sk-stolen"]),
    ("anthropic-beta", ["a" * 600, "b" * 600]),
    ("anthropic-version", ["2023-06-01", "2024-10-22"]),
    ("anthropic-version", [""]),
])
async def test_count_tokens_checks_the_headers_as_messages_does(served, header, values):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.port}") as client:
        async def count(headers: list[tuple[str, Any]]) -> httpx.Response:
            return await client.post("/v1/messages/count_tokens", json={
                "model": "native", "messages": HELLO["messages"]}, headers=[
                ("x-api-key", served.tenant.key), *headers])

        response = await count([(header, value) for value in values])
        assert response.status_code == 400
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(f"{header}:")
        assert "sk-stolen" not in response.text
        for good in ([], [("anthropic-version", "2023-06-01"),
                          ("anthropic-beta", f"{BETAS[0]},{BETAS[1]}")]):
            response = await count(good)
            assert response.status_code == 200, response.text
            assert response.json()["input_tokens"] > 0
    assert served.mocks["native"].mock.stats.requests == 0  # counted here, as before


async def test_a_translated_request_takes_the_betas_and_does_not_forward_them(served):
    response = await post_message(served, "plain", [("anthropic-beta", ",".join(BETAS)),
                                                    ("anthropic-version", "2024-10-22")])
    assert response.status_code == 200 and response.json()["content"][0]["text"] == DEFAULT_REPLY
    got = served.got("chat")
    assert got["path"] == "/v1/chat/completions"
    assert "anthropic-beta" not in got["headers"] and "anthropic-version" not in got["headers"]


# ---- no native API: translated as before ------------------------------------------------------

async def test_a_deployment_without_native_apis_still_gets_chat_completions(served):
    async with served.openai() as sdk, served.anthropic() as claude:
        response = await sdk.responses.create(model="plain", input="Say hello")
        assert response.output_text == DEFAULT_REPLY
        got = served.got("chat")
        assert got["path"] == "/v1/chat/completions" and got["body"]["model"] == "up-plain"
        assert got["body"]["messages"] == [{"role": "user", "content": "Say hello"}]
        message = await claude.messages.create(
            model="plain", max_tokens=50, messages=[{"role": "user", "content": "Hi"}])
        assert message.content[0].text == DEFAULT_REPLY
        assert served.got("chat")["path"] == "/v1/chat/completions"
    assert served.mocks["native"].mock.stats.requests == 0
