"""The mock upstream, live on a free loopback port, called with the official openai client."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.common.mock_upstream import DEFAULT_REPLY, MockConfig, MockServerThread, build_app

ROOT = Path(__file__).resolve().parents[2]
REPLY_TOKENS = len(DEFAULT_REPLY.split(" "))
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    """``python -m bench.common.mock_upstream --port 0`` as a process; its base URL."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.common.mock_upstream", "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the server prints one line once it accepts connections
        assert "listening on http://127.0.0.1:" in line, line
        yield line.strip().rsplit(" ", 1)[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def client(live_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_url}/v1", api_key="sk-tenant-key", max_retries=0)


def last_request(url: str) -> dict:
    return httpx.get(f"{url}/_last_request").json()


def test_chat_completion_echoes_model_with_usage(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="any-model", messages=MESSAGES)
    assert resp.model == "any-model"
    assert resp.choices[0].message.content == DEFAULT_REPLY
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == REPLY_TOKENS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + REPLY_TOKENS


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="mock-model", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == DEFAULT_REPLY
    assert all(c.model == "mock-model" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == REPLY_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == DEFAULT_REPLY


def test_max_tokens_cuts_the_reply(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 2
    assert resp.choices[0].message.content == " ".join(DEFAULT_REPLY.split(" ")[:2])


def test_completions_plain_and_stream(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="text-model", prompt="Once upon a time")
    assert resp.model == "text-model" and resp.choices[0].text == DEFAULT_REPLY
    assert resp.usage is not None and resp.usage.prompt_tokens == 4
    chunks = list(client.completions.create(model="text-model", prompt="x", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == DEFAULT_REPLY
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == REPLY_TOKENS


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["mock-model"]


def test_last_request_records_the_authorization_seen(client: openai.OpenAI,
                                                     live_url: str) -> None:
    client.chat.completions.create(model="seen-model", messages=MESSAGES, user="u1")
    seen = last_request(live_url)
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["authorization"] == "Bearer sk-tenant-key"
    assert seen["body"]["model"] == "seen-model" and seen["body"]["user"] == "u1"
    stats = httpx.get(f"{live_url}/_stats").json()
    assert stats["requests"] >= 1


def test_invalid_json_is_a_400(live_url: str) -> None:
    resp = httpx.post(f"{live_url}/v1/chat/completions", content=b"{not json")
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{live_url}/v1/nothing").status_code == 404


def raw_exchange(port: int, payload: bytes, limit: int = 100) -> bytes:
    """Send raw bytes and read until the server closes the connection (bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        data = b""
        for _ in range(limit):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_pipelined_and_chunked_requests_are_answered_in_order() -> None:
    body = b'{"model":"a","prompt":"x"}'
    first = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
             % (len(body), body))
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (5, body[:5], len(body) - 5, body[5:])
    second = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
              b"Connection: close\r\n\r\n" + chunked)
    with MockServerThread() as mock:
        data = raw_exchange(mock.port, first + second)
    responses = data.split(b"HTTP/1.1 ")[1:]
    assert len(responses) == 2, data
    assert all(r.startswith(b"200 OK") for r in responses)
    assert b'"id":"cmpl-mock-1"' in responses[0] and b'"id":"cmpl-mock-2"' in responses[1]
    assert b"connection: close" in responses[1]


def test_malformed_request_line_gets_a_400_and_close() -> None:
    with MockServerThread() as mock:
        data = raw_exchange(mock.port, b"NONSENSE\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400 ") and b"connection: close" in data


def test_fail_rate_gives_openai_shaped_500s() -> None:
    with MockServerThread(MockConfig(fail_rate=1.0)) as mock:
        client = openai.OpenAI(base_url=mock.base_url, api_key="k", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m", messages=MESSAGES)
        assert mock.mock.stats.failures == 1


def test_fail_rate_is_a_share_of_requests() -> None:
    with MockServerThread(MockConfig(fail_rate=0.5, seed=1)) as mock, httpx.Client() as http:
        codes = [http.post(f"{mock.base_url}/chat/completions",
                           json={"model": "m", "messages": MESSAGES}).status_code
                 for _ in range(200)]
    assert set(codes) == {200, 500}
    assert 60 <= codes.count(500) <= 140


def test_require_key_checks_the_bearer_key() -> None:
    with MockServerThread(MockConfig(require_key="sk-upstream-secret")) as mock:
        bad = openai.OpenAI(base_url=mock.base_url, api_key="sk-tenant", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="m", messages=MESSAGES)
        good = openai.OpenAI(base_url=mock.base_url, api_key="sk-upstream-secret",
                             max_retries=0)
        assert good.chat.completions.create(model="m", messages=MESSAGES).choices


def test_delay_and_chunk_delay() -> None:
    config = MockConfig(delay_ms=150, chunk_delay_ms=5)
    with MockServerThread(config) as mock:
        client = openai.OpenAI(base_url=mock.base_url, api_key="k", max_retries=0)
        start = time.monotonic()
        client.chat.completions.create(model="m", messages=MESSAGES)
        assert time.monotonic() - start >= 0.1  # a lower bound only: never flaky under load
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == DEFAULT_REPLY


def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    with MockServerThread() as mock, httpx.Client(
            limits=httpx.Limits(max_connections=1)) as http:
        for _ in range(50):
            assert http.post(f"{mock.base_url}/completions",
                             json={"model": "m", "prompt": "p"}).status_code == 200
    assert mock.mock.stats.requests == 50


async def test_asgi_app_plain_and_stream() -> None:
    app = build_app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://mock") as http:
        resp = await http.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                               headers={"Authorization": "Bearer sk-x"})
        assert resp.status_code == 200 and resp.json()["model"] == "m"
        seen = app.mock.last_request  # type: ignore[attr-defined]
        assert seen["headers"]["authorization"] == "Bearer sk-x"
        resp = await http.post("/v1/chat/completions",
                               json={"model": "m", "messages": MESSAGES, "stream": True})
        events = [line for line in resp.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        first = json.loads(events[0].removeprefix("data: "))
        assert first["object"] == "chat.completion.chunk"


# The benchmark's load generator (bench/common/gateway_loadgen.py) against the mock.


def test_loadgen_parser_handles_bytes_arriving_one_at_a_time() -> None:
    from bench.common.gateway_loadgen import ResponseParser

    events = b"data: {}\n\n"
    chunked = (b"HTTP/1.1 200 OK\r\nX-Gateway-Overhead-Ms: 0.25\r\n"
               b"transfer-encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n" % (len(events), events) + b"0\r\n\r\n")
    plain = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\n\r\n{}"
    for raw, status in ((chunked, 200), (plain, 429)):
        parser = ResponseParser(b"\r\nx-gateway-overhead-ms:")
        results = [parser.feed(raw[i:i + 1]) for i in range(len(raw))]
        assert results[-1] == 0 and set(results[:-1]) == {-1}
        assert parser.status == status
    assert ResponseParser(None).feed(plain + b"extra") == len(b"extra")


@pytest.mark.parametrize("stream", [False, True])
async def test_loadgen_against_the_mock(stream: bool) -> None:
    from bench.common.gateway_loadgen import Spec, run

    body = {"model": "m", "messages": MESSAGES, "stream": stream}
    with MockServerThread() as mock:
        spec = Spec(url=f"{mock.base_url}/chat/completions", body=json.dumps(body),
                    headers={"Authorization": "Bearer sk-x"}, concurrency=4, requests=200,
                    duration_s=30, warmup_requests=20, warmup_s=5)
        result = await run(spec)
        assert mock.mock.stats.requests == 220
    assert result["completed"] == result["ok"] == 200
    assert result["warmup"]["completed"] == 20 and result["socket_errors"] == 0
    assert result["latency_ms"]["p50"] is not None
