"""`switchboard serve` as a newcomer runs it: SQLite, in-process limiter, embedded SmolLM2.

Driven with the official `openai` client against the live server; the admin API sets up a
tenant from the bootstrap admin key printed at first start.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.support import REPO, free_port, wait_http

pytestmark = pytest.mark.slow


class Live:
    def __init__(self, base: str, admin_key: str, db_path: Path) -> None:
        self.base = base
        self.admin = {"authorization": f"Bearer {admin_key}"}
        self.db_path = db_path

    def tenant_key(self, name: str, **plan: object) -> str:
        p = httpx.post(f"{self.base}/admin/plans", json={"name": f"{name}-plan", **plan},
                       headers=self.admin).json()
        t = httpx.post(f"{self.base}/admin/tenants", json={"name": name, "plan_id": p["id"]},
                       headers=self.admin).json()
        k = httpx.post(f"{self.base}/admin/tenants/{t['id']}/keys", json={},
                       headers=self.admin)
        assert k.status_code == 201, k.text
        return k.json()["key"]


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_path) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "SWITCHBOARD_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/gw.db",
           "SWITCHBOARD_SECRET_FILE": str(tmp / "secret"),
           "SWITCHBOARD_USAGE_OUTBOX_DIR": str(tmp / "outbox"),
           "SWITCHBOARD_LOG_LEVEL": "warning",  # stdout is a pipe read only up to the key
           "SWITCHBOARD_EMBEDDED__KV_CACHE_MEMORY": str(128 << 20)}
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        admin_key = _read_admin_key(proc)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", timeout_s=180, proc=proc)
        yield Live(base, admin_key, tmp / "gw.db")
    finally:
        proc.terminate()
        proc.wait(30)


def _read_admin_key(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for _ in range(200):
        line = proc.stdout.readline()
        if not line:
            break
        if line.strip().startswith("sk-sb-admin-"):
            return line.strip()
    raise RuntimeError(f"no bootstrap admin key printed (exit code {proc.poll()})")


def client(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base}/v1", api_key=key, max_retries=0, timeout=120)


def test_bootstrap_key_is_stored_hashed(live):
    key = live.admin["authorization"].split()[1]
    secret = key.rsplit("-", 1)[1]
    assert secret.encode() not in live.db_path.read_bytes()
    r = httpx.get(f"{live.base}/admin/admin-keys", headers=live.admin)
    assert r.status_code == 200 and "key" not in r.json()[0]


def test_chat_completions_and_streaming(live):
    oa = client(live, live.tenant_key("alpha"))
    models = [m.id for m in oa.models.list()]
    assert models == ["all-minilm-l6-v2", "smollm2-135m-instruct", "auto"]
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    raw = oa.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=16, temperature=0)
    assert raw.headers["x-request-id"] and "x-gateway-overhead-ms" in raw.headers
    reply = raw.parse()
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 16 and reply.usage.prompt_tokens > 10

    stream = oa.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_headers={"cache-control": "no-cache"})  # past the response cache, to the engine
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    # The same prompt again: its full blocks come from the prefix cache the first call filled.
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16

    done = oa.completions.create(model="smollm2-135m-instruct", prompt="1, 2, 3,",
                                 max_tokens=6, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens <= 6


def test_errors_reach_the_client_typed(live):
    oa = client(live, live.tenant_key("beta"))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="nope", messages=messages)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                   temperature=7)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        client(live, "sk-sb-aaaaaaaaaaaa-" + "0" * 40).models.list()


def test_rate_limit_reaches_the_client(live):
    oa = client(live, live.tenant_key("gamma", rpm=1))
    messages = [{"role": "user", "content": "hi"}]
    oa.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        oa.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                   max_tokens=1)
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_client_disconnect_mid_stream_aborts_the_engine(live):
    key = live.tenant_key("delta")
    body = {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 500,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Count to a thousand."}]}
    with httpx.stream("POST", f"{live.base}/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {key}"}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # The connection is closed after one event; 500 tokens would take far longer than this.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = httpx.get(f"{live.base}/health").json()["deployments"]["embedded"]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"engine still busy after the client left: {stats}")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with sqlite3.connect(live.db_path) as db:
            rows = db.execute("select status, completion_tokens from usage_records "
                              "where status = 'aborted'").fetchall()
        if rows:
            break
        time.sleep(0.2)
    assert rows and 0 < rows[0][1] < 500


# --- the OpenAI surface on the embedded SmolLM2: tools, structured outputs, logit_bias ------

SMOL = "smollm2-135m-instruct"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed(stream) -> tuple[str, dict[int, dict[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] = call.function.name or slot["name"]
                    slot["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_tool_calls_named_required_and_a_round_trip(live):
    import jsonschema

    oa = client(live, live.tenant_key("agents"))
    params = WEATHER_TOOL["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, finish in ((named, "stop"), ("required", "tool_calls")):
        reply = oa.chat.completions.create(model=SMOL, messages=ASK, tools=[WEATHER_TOOL],
                                           tool_choice=choice, temperature=0, max_tokens=48)
        (call,) = reply.choices[0].message.tool_calls[:1]
        assert reply.choices[0].finish_reason == finish and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), params)
        content, calls, streamed_finish = _streamed(oa.chat.completions.create(
            model=SMOL, messages=ASK, tools=[WEATHER_TOOL], tool_choice=choice,
            temperature=0, max_tokens=48, stream=True,
            extra_headers={"cache-control": "no-cache"}))
        assert streamed_finish == finish and content == ""
        assert calls[0]["name"] == "get_weather"
        assert calls[0]["arguments"] == call.function.arguments  # greedy: the same call
    # The tool's answer goes back, and the model answers in words.
    history = [*ASK, reply.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21C and sunny"}]
    final = oa.chat.completions.create(model=SMOL, messages=history, tools=[WEATHER_TOOL],
                                       tool_choice="none", temperature=0, max_tokens=24)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    assert final.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result


def test_auto_tool_calls_are_parsed_from_the_text(live):
    oa = client(live, live.tenant_key("auto-agent"))
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # vLLM's structured_outputs extra makes this small model write what a tool-tuned one would.
    regex = "".join("\\n" if c == "\n" else ("\\" + c if c in "{}[]().\\" else c)
                    for c in block)
    reply = oa.chat.completions.create(
        model=SMOL, messages=ASK, tools=[WEATHER_TOOL], temperature=0, max_tokens=64,
        extra_body={"structured_outputs": {"regex": regex}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_json_modes_always_parse_and_validate(live):
    import jsonschema

    oa = client(live, live.tenant_key("json"))
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"capital": {"type": "string", "maxLength": 30},
                             "population_millions": {"type": "integer"}},
              "required": ["capital", "population_millions"]}
    ask = [{"role": "user", "content": "Describe France's capital as JSON."}]
    strict = oa.chat.completions.create(
        model=SMOL, messages=ask, temperature=0.8, seed=3, max_tokens=64,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(strict.choices[0].message.content), schema)
    loose = oa.chat.completions.create(model=SMOL, messages=ask, temperature=0,
                                       max_tokens=96, response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=SMOL, messages=ask, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert err.value.body["param"].startswith("response_format")


def test_a_schema_that_never_ends_is_a_400_before_generating(live):
    """Issue 40: a schema that requires itself without end was answered 200 with `{"` and
    finish_reason "stop"; it is a 400 naming response_format, before any token is made."""
    oa = client(live, live.tenant_key("endless"))
    endless = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            oa.chat.completions.create(
                model=SMOL, messages=[{"role": "user", "content": "Nest."}], max_tokens=32,
                stream=stream, response_format={"type": "json_schema", "json_schema": {
                    "name": "endless", "schema": endless, "strict": True}})
        assert err.value.body["param"] == "response_format.json_schema.schema"
        assert "recurses without end" in err.value.body["message"]
        assert "#/properties/n" in err.value.body["message"]


def test_logit_bias_is_honoured(live, smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    oa = client(live, live.tenant_key("bias"))
    ask = [{"role": "user", "content": "Name a fruit."}]
    plain = oa.chat.completions.create(model=SMOL, messages=ask, temperature=0, max_tokens=1)
    first = tokenizer.encode(plain.choices[0].message.content)[0]
    banned = oa.chat.completions.create(model=SMOL, messages=ask, temperature=0, max_tokens=1,
                                        logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].message.content)[0] != first
    (mango,) = tokenizer.encode("Mango")[:1]
    forced = oa.chat.completions.create(model=SMOL, messages=ask, temperature=0, max_tokens=1,
                                        logit_bias={str(mango): 100})
    assert forced.choices[0].message.content == tokenizer.decode([mango])


def test_images_and_unknown_fields_are_refused_by_name(live):
    oa = client(live, live.tenant_key("vision"))
    picture = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=SMOL, messages=picture)
    assert err.value.body["param"] == "messages.0.content.1"
    assert err.value.body["code"] == "unsupported_parameter"
    assert "does not support images" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=SMOL, messages=ASK, extra_body={"guided_decoding": 1})
    assert err.value.body["param"] == "guided_decoding"


def test_tool_messages_must_answer_the_assistants_calls(live):
    """As OpenAI: a `tool` message with no assistant `tool_calls` before it, or answering an
    id those calls do not hold, is a 400 naming the message; a valid history is a 200."""
    oa = client(live, live.tenant_key("tool-history"))
    asked = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_paris", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    answer = {"role": "tool", "tool_call_id": "call_paris", "content": "21C and sunny"}
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model=SMOL, messages=[*ASK, answer], tools=[WEATHER_TOOL],
                                   max_tokens=1)
    assert err.value.body["type"] == "invalid_request_error"
    assert err.value.body["param"] == "messages.1.role"
    assert "preceding assistant message with 'tool_calls'" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(
            model=SMOL, messages=[*ASK, asked, {**answer, "tool_call_id": "call_oslo"}],
            tools=[WEATHER_TOOL], max_tokens=1, stream=True)
    assert err.value.body["type"] == "invalid_request_error"
    assert err.value.body["param"] == "messages.2.tool_call_id"
    assert "'call_oslo'" in err.value.body["message"]
    reply = oa.chat.completions.create(model=SMOL, messages=[*ASK, asked, answer], max_tokens=1)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 1
