"""Tokenizing is never done on the event loop, and an impossible prompt is refused before any
tokenizer runs (issue: one tenant's huge bodies stalled every other request)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.gateway.support import bearer, gateway_client, seed_tenant, settings
from workers.async_engine import AsyncLLMEngine
from workers.client import EmbeddedClient


@pytest.fixture
async def world(sqlite_url, tmp_path, tiny_llama_path, monkeypatch):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="t", plan={"rpm": 2})
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny"})
    seen: list[str] = []
    gate = threading.Event()
    gate.set()
    real = EmbeddedClient.prepare

    def watched(self, body, **kwargs):
        seen.append(threading.current_thread().name)
        gate.wait(30)
        return real(self, body, **kwargs)

    monkeypatch.setattr(EmbeddedClient, "prepare", watched)
    async with gateway_client(cfg, engine=engine) as client:
        client.headers.update(bearer(tenant.key))
        yield client, seen, gate


def ask(text: str) -> dict:
    return {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}


async def test_an_impossible_prompt_is_refused_before_tokenizing(world):
    client, seen, _ = world
    deployment = client._transport.app.state.gateway.deployments.route("tiny").deployments[0]
    longest = deployment.client.max_token_chars
    window = deployment.client.context_window
    r = await client.post("/v1/chat/completions", json=ask("x" * (longest * window)))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert seen == []  # no tokenizer ran


async def test_tokenizing_runs_off_the_loop_while_others_are_answered(world):
    client, seen, gate = world
    gate.clear()  # the next tokenization blocks until released
    slow = asyncio.create_task(client.post("/v1/chat/completions", json=ask("hello " * 500)))
    while not seen:
        await asyncio.sleep(0.01)
    assert seen[0] != threading.current_thread().name  # a worker thread, not the loop's
    live = await client.get("/health/live")  # answered while the tokenizer is still busy
    assert live.status_code == 200 and not slow.done()
    gate.set()
    done = await slow
    assert done.status_code == 200, done.text


async def test_a_request_its_limits_refuse_is_never_tokenized(world):
    client, seen, _ = world
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=ask("hi"))).status_code == 200
    assert len(seen) == 2
    refused = await client.post("/v1/chat/completions", json=ask("hi " * 2000))
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(seen) == 2  # the refused one cost no tokenizing


async def test_an_exact_refusal_after_admission_gives_the_reservation_back(world):
    client, seen, _ = world
    deployment = client._transport.app.state.gateway.deployments.route("tiny").deployments[0]
    window = deployment.client.context_window
    # Short enough for the cheap bound, too long once tokenized: refused after admission.
    r = await client.post("/v1/chat/completions", json=ask("hello " * window))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert len(seen) == 1
    ok = await client.post("/v1/chat/completions", json=ask("hi"))
    assert ok.status_code == 200, ok.text  # the rpm=2 plan still had room for it


@pytest.fixture
async def flood(sqlite_url, tmp_path, tiny_llama_path, monkeypatch):
    """A 1-RPM tenant and a normal one; every parse of a request body is counted."""
    from gateway import request_path

    hostile = await seed_tenant(sqlite_url, tmp_path, name="hostile", plan={"rpm": 1})
    normal = await seed_tenant(sqlite_url, tmp_path, name="normal")
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20)
    cfg = settings(sqlite_url, tmp_path, embedded={"name": "tiny"})
    parsed: list[int] = []
    real = request_path.parse_body

    def counted(raw, **kwargs):
        parsed.append(len(raw))
        return real(raw, **kwargs)

    monkeypatch.setattr(request_path, "parse_body", counted)
    async with gateway_client(cfg, engine=engine) as client:
        yield client, hostile, normal, parsed


async def test_a_key_over_its_rpm_is_refused_before_its_body_is_parsed(flood):
    client, hostile, normal, parsed = flood
    first = await client.post("/v1/chat/completions", json=ask("hi"),
                              headers=bearer(hostile.key))
    assert first.status_code == 200, first.text
    second = await client.post("/v1/chat/completions", json=ask("hi"),
                               headers=bearer(hostile.key))
    assert second.status_code == 429 and len(parsed) == 2  # the limiter refused it, parsed
    # Within the hold: a 429 before parsing, even for a body that is not JSON at all (it
    # would be a 400 if it were parsed) and for one far past any context window. Each answer
    # waits out the hold, so both are sent inside it, together.
    headers = {**bearer(hostile.key), "content-type": "application/json"}
    held = await asyncio.gather(*(
        client.post("/v1/chat/completions", content=body, headers=headers)
        for body in (b"{not json", json_bytes(ask("x " * 200_000)))))
    for r in held:
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["retry-after"]) <= int(second.headers["retry-after"])
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(parsed) == 2
    ok = await client.post("/v1/chat/completions", json=ask("hi"), headers=bearer(normal.key))
    assert ok.status_code == 200, ok.text  # another tenant is not held
    assert len(parsed) == 3
    # The held answers came when the hold was over: the next request is read again, and
    # as the key is still over its RPM, its 400 becomes a 429 (and a new hold).
    after = await client.post("/v1/chat/completions", content=b"{not json", headers=headers)
    assert after.status_code == 429 and len(parsed) == 4


async def test_requests_refused_as_invalid_count_against_rpm(flood):
    """Oversized prompts, each refused by the cheap bound: the first is a 400 and uses the
    1-RPM plan's request; the second, parsed, is a 429; the third is refused unparsed."""
    client, hostile, normal, parsed = flood
    headers = {**bearer(hostile.key), "content-type": "application/json"}
    huge = json_bytes(ask("x " * 200_000))
    first = await client.post("/v1/chat/completions", content=huge, headers=headers)
    assert first.status_code == 400 and first.json()["error"]["code"] == "context_length_exceeded"
    second = await client.post("/v1/chat/completions", content=huge, headers=headers)
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "rate_limit_exceeded" and len(parsed) == 2
    third = await client.post("/v1/chat/completions", content=huge, headers=headers)
    assert third.status_code == 429 and len(parsed) == 2  # held: not parsed
    ok = await client.post("/v1/chat/completions", json=ask("hi"), headers=bearer(normal.key))
    assert ok.status_code == 200, ok.text


def json_bytes(body: dict) -> bytes:
    import json

    return json.dumps(body).encode()
