"""`switchboard worker` as a live process on loopback, called with the official openai client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.gateway.support import REPO, free_port, wait_http

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(smollm2_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", "--port", str(port),
         "--kv-cache-memory", str(256 << 20)],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/health", timeout_s=120, proc=proc)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_chat_completion(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=20,
    )
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 10


def test_streamed_chat_equals_non_streamed_and_reports_usage(client):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=30)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]


def test_completions_with_stop_and_n(client):
    resp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20,
                                     temperature=0.8, seed=1, n=3, stop=["9"])
    assert len(resp.choices) == 3
    assert all("9" not in c.text for c in resp.choices)


def test_bad_requests_get_openai_shaped_4xx(server, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=-3)
    assert "temperature" in err.value.body["message"]
    bad = httpx.post(f"{server}/v1/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    bad = httpx.post(f"{server}/v1/completions", content=b"\xff\xfe")
    assert bad.status_code == 400
    bad = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                       "max_tokens": "many"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    bad = httpx.post(f"{server}/v1/completions", json={"prompt": "x"})  # as OpenAI: required
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
    bad = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                       "max_tokens": 900_000})
    assert bad.status_code == 400 and "context length" in bad.json()["error"]["message"]


def wait_idle(server: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = httpx.get(f"{server}/health").json()
        if stats["num_running"] == 0 and stats["kv_cache_usage"] == 0:
            break
        time.sleep(0.1)
    return stats


def test_non_streamed_client_timeout_aborts_the_engine_request(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.5)
    stats = wait_idle(server)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0


def test_client_disconnect_aborts_the_engine_request(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                break  # got tokens: hang up mid-stream
    stats = wait_idle(server)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0
