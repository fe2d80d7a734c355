"""Response caches through the whole gateway, in-process and in Redis: what is cached, what
is not, streaming from cache, Cache-Control, tenant isolation, and how hits are metered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest
import yaml
from sqlalchemy import select

from bench.common.mock_upstream import MockConfig, MockServerThread, MockStats
from gateway.app import create_app
from tenancy.db import make_engine, make_sessionmaker
from tenancy.models import UsageRecord
from tests.gateway.support import Seeded, bearer, in_process, seed_tenant, settings

MODEL = "chat"
NATIVE = "claude"  # a deployment that speaks Anthropic's Messages natively
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def upstream() -> Iterator[MockServerThread]:
    server = MockServerThread(MockConfig(reply="Paris is the capital of France.")).start()
    yield server
    server.stop()


@dataclass
class World:
    client: httpx.AsyncClient
    tenants: dict[str, Seeded]
    upstream: MockServerThread
    db_url: str

    async def chat(self, content: str, *, tenant: str = "a", system: str | None = None,
                   headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": content}]
        body = {"model": MODEL, "messages": messages, "temperature": 0, **extra}
        return await self.client.post("/v1/chat/completions", json=body, headers={
            **bearer(self.tenants[tenant].key), **(headers or {})})

    @property
    def upstream_calls(self) -> int:
        return self.upstream.mock.stats.requests

    async def usage(self) -> list[UsageRecord]:
        engine = make_engine(self.db_url)
        try:
            async with make_sessionmaker(engine)() as session:
                return list(await session.scalars(select(UsageRecord).order_by(UsageRecord.id)))
        finally:
            await engine.dispose()


@pytest.fixture(params=["memory", "redis"])
async def world(request, sqlite_url, tmp_path, upstream) -> AsyncIterator[World]:
    upstream.mock.stats = MockStats()
    path = tmp_path / "routing.yaml"
    prices = {"input_price_per_1m": "1000", "output_price_per_1m": "2000"}
    path.write_text(yaml.safe_dump({"deployments": [
        {"name": "up", "model_name": MODEL, "provider": "openai", "base_url": upstream.base_url,
         **prices},
        # the same upstream, sent /v1/messages as it is (with the client's Anthropic headers)
        {"name": "up-messages", "model_name": NATIVE, "provider": "openai",
         "base_url": upstream.base_url, "native_apis": ["messages"], **prices}]}))
    redis = REDIS_URL if request.param == "redis" else ""
    cfg = settings(sqlite_url, tmp_path, deployments_file=path, redis_url=redis)
    tenants = {
        "a": await seed_tenant(sqlite_url, tmp_path, name="initech",
                               plan={"cache_mode": "semantic", "cache_hit_price_percent": 10}),
        "b": await seed_tenant(sqlite_url, tmp_path, name="umbrella",
                               plan={"cache_mode": "semantic"}),
        "plain": await seed_tenant(sqlite_url, tmp_path, name="hooli"),
    }
    async with in_process(create_app(cfg)) as client:
        yield World(client, tenants, upstream, sqlite_url)


def cache_of(r: httpx.Response) -> tuple[str, str | None]:
    assert r.status_code == 200, r.text
    return r.headers["x-cache"], r.headers.get("x-cache-kind")


async def settle(world: World) -> None:
    """Stores happen in the background; wait for them."""
    state = world.client._transport.app.state.gateway  # type: ignore[attr-defined]
    while state.background:
        await asyncio.gather(*list(state.background), return_exceptions=True)


async def test_deterministic_requests_hit_the_exact_cache(world):
    first = await world.chat("What is the capital of France?", tenant="plain")
    assert cache_of(first) == ("miss", None)
    await settle(world)
    second = await world.chat("What is the capital of France?", tenant="plain")
    assert cache_of(second) == ("hit", "exact")
    assert world.upstream_calls == 1
    a, b = first.json(), second.json()
    assert b["choices"] == a["choices"] and b["usage"]["completion_tokens"] == a["usage"][
        "completion_tokens"]
    assert b["id"] != a["id"] and b["model"] == MODEL
    assert b["usage"]["prompt_tokens_details"] == {"cached_tokens": a["usage"]["prompt_tokens"]}
    # A parameter that changes the output is another entry.
    assert cache_of(await world.chat("What is the capital of France?", tenant="plain",
                                     max_tokens=3)) == ("miss", None)


async def test_sampled_requests_are_not_cached_unless_asked(world):
    for _ in range(2):
        r = await world.chat("Tell me a story", tenant="plain", temperature=0.9)
        assert cache_of(r) == ("miss", None)
        await settle(world)
    assert world.upstream_calls == 2
    opt_in = {"x-switchboard-cache": "exact"}
    await world.chat("Tell me a story", tenant="plain", temperature=0.9, headers=opt_in)
    await settle(world)
    r = await world.chat("Tell me a story", tenant="plain", temperature=0.9, headers=opt_in)
    assert cache_of(r) == ("hit", "exact")
    # A fixed seed makes the output deterministic: cached by default.
    await world.chat("Tell me a story", tenant="plain", temperature=0.9, seed=5)
    await settle(world)
    r = await world.chat("Tell me a story", tenant="plain", temperature=0.9, seed=5)
    assert cache_of(r) == ("hit", "exact")
    # "off" always wins.
    r = await world.chat("Tell me a story", tenant="plain", temperature=0.9, seed=5,
                         headers={"x-switchboard-cache": "off"})
    assert cache_of(r) == ("miss", None)


async def test_cache_control_no_cache_and_no_store(world):
    await world.chat("Capital of Spain?", tenant="plain", headers={"cache-control": "no-store"})
    await settle(world)
    assert cache_of(await world.chat("Capital of Spain?", tenant="plain")) == ("miss", None)
    await settle(world)
    r = await world.chat("Capital of Spain?", tenant="plain", headers={"cache-control": "no-cache"})
    assert cache_of(r) == ("miss", None)  # looked past the cache...
    await settle(world)
    assert cache_of(await world.chat("Capital of Spain?", tenant="plain")) == ("hit", "exact")
    assert world.upstream_calls == 3  # ...and refreshed it


async def test_caches_are_partitioned_per_tenant(world):
    question = "What is the capital of France?"
    await world.chat(question, tenant="a")
    await settle(world)
    assert cache_of(await world.chat(question, tenant="a")) == ("hit", "exact")
    # Another tenant on a plan with the same settings sees neither entry of the first: not
    # the semantic one for a paraphrase, not the exact one for the same request.
    assert cache_of(await world.chat("Which city is the capital of France?",
                                     tenant="b")) == ("miss", None)
    await settle(world)
    assert cache_of(await world.chat(question, tenant="b")) == ("hit", "semantic")  # its own
    assert world.upstream_calls == 2


async def test_semantic_cache_serves_paraphrases_only(world):
    await world.chat("What is the capital of France?", tenant="a")
    await settle(world)
    r = await world.chat("What's the capital city of France?", tenant="a")
    assert cache_of(r) == ("hit", "semantic")
    assert 0 < float(r.headers["x-cache-similarity"]) <= 1
    assert cache_of(await world.chat("What is the capital of Germany?",
                                     tenant="a")) == ("miss", None)
    # Scoped by system prompt: the same question under another one is another conversation.
    r = await world.chat("What's the capital city of France?", tenant="a",
                         system="Answer in French.")
    assert cache_of(r) == ("miss", None)
    # Plans without the semantic cache only get it when the request asks.
    await world.chat("How tall is Mount Everest?", tenant="plain")
    await settle(world)
    r = await world.chat("What is the height of Mount Everest?", tenant="plain")
    assert cache_of(r) == ("miss", None)
    semantic = {"x-switchboard-cache": "semantic"}
    await world.chat("How do I boil an egg?", tenant="plain", headers=semantic)
    await settle(world)
    r = await world.chat("What is the way to boil an egg?", tenant="plain", headers=semantic)
    assert cache_of(r) == ("hit", "semantic")


async def test_hits_stream_like_live_answers(world):
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=world.tenants["a"].key,
                                http_client=world.client, max_retries=0)
    messages = [{"role": "user", "content": "Capital of France, please."}]
    live = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert live.headers["x-cache"] == "miss"
    live_chunks = [c async for c in live.parse()]
    await settle(world)
    cached = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert cached.headers["x-cache"] == "hit"
    chunks = [c async for c in cached.parse()]

    def text(cs: list[Any]) -> str:
        return "".join(c.choices[0].delta.content or "" for c in cs if c.choices)

    assert text(chunks) == text(live_chunks) == "Paris is the capital of France."
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert chunks[-1].usage.completion_tokens == live_chunks[-1].usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == "stop"
    # And the streamed answer serves a non-streamed request too.
    plain = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0)
    assert plain.headers["x-cache"] == "hit"
    assert plain.parse().choices[0].message.content == "Paris is the capital of France."
    assert world.upstream_calls == 1


async def test_hits_are_metered_as_cached_at_the_plan_price(world):
    await world.chat("What is the capital of France?", tenant="a")
    await settle(world)
    await world.chat("What is the capital of France?", tenant="a")
    await world.chat("What is the capital of France?", tenant="plain")
    await settle(world)
    await world.chat("What is the capital of France?", tenant="plain")
    state = world.client._transport.app.state.gateway  # type: ignore[attr-defined]
    await state.meter.flush()
    rows = await world.usage()
    assert [(r.cache_hit, r.deployment) for r in rows] == [
        ("none", "up"), ("exact", ""), ("none", "up"), ("exact", "")]
    live, hit_a, _, hit_plain = rows
    assert hit_a.prompt_tokens == live.prompt_tokens
    assert hit_a.completion_tokens == live.completion_tokens
    full = Decimal(live.cost_micros)
    assert hit_a.cost_micros == int(-(-full * 10 // 100))  # plan "a" pays 10% on hits
    assert hit_plain.cost_micros == 0  # the default plan pays nothing for hits


async def test_failed_and_cut_answers_are_never_cached(world):
    from bench.common.mock_upstream import MockMode

    world.upstream.mock.mode = MockMode(cut_after_events=3)
    try:
        async with world.client.stream("POST", "/v1/chat/completions", headers=bearer(
                world.tenants["plain"].key), json={
                "model": MODEL, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": "cut me"}]}) as r:
            body = "".join([line async for line in r.aiter_lines()])
        assert json.loads(body.split("data: ")[-1])["error"]
    finally:
        world.upstream.mock.mode = MockMode()
    await settle(world)
    assert cache_of(await world.chat("cut me", tenant="plain")) == ("miss", None)


async def test_anthropic_betas_and_version_are_part_of_a_messages_key(world):
    """A native Messages upstream is sent the client's anthropic-beta and anthropic-version,
    and a beta can change its answer: the same request with other betas (or none, or another
    version) is another entry, exact and semantic; the same betas, in any order, hit."""
    beta, other = "prompt-caching-2024-07-31", "token-efficient-tools-2025-02-19"

    async def message(content: str, tenant: str = "plain", **headers: str) -> httpx.Response:
        return await world.client.post("/v1/messages", json={
            "model": NATIVE, "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}, headers={
            **bearer(world.tenants[tenant].key),
            **{name.replace("_", "-"): value for name, value in headers.items()}})

    question = "What is the capital of France?"
    assert cache_of(await message(question)) == ("miss", None)
    await settle(world)
    assert cache_of(await message(question)) == ("hit", "exact")
    assert cache_of(await message(question, anthropic_beta=beta)) == ("miss", None)
    assert world.upstream.mock.last_request["headers"]["anthropic-beta"] == beta
    await settle(world)
    assert cache_of(await message(question, anthropic_beta=beta)) == ("hit", "exact")
    assert cache_of(await message(question, anthropic_beta=f"{beta},{other}")) == ("miss", None)
    await settle(world)
    assert cache_of(await message(question, anthropic_beta=f"{other}, {beta}")) == (
        "hit", "exact")  # the same set of betas
    assert cache_of(await message(question, anthropic_version="2024-10-22")) == ("miss", None)
    await settle(world)
    assert cache_of(await message(question, anthropic_version="2024-10-22")) == ("hit", "exact")
    assert cache_of(await message(question)) == ("hit", "exact")  # the first is still its own
    assert world.upstream_calls == 4
    # Semantic (plan "a"): a paraphrase is matched within the same betas only.
    assert cache_of(await message(question, "a", anthropic_beta=beta)) == ("miss", None)
    await settle(world)
    paraphrase = "What's the capital city of France?"
    assert cache_of(await message(paraphrase, "a")) == ("miss", None)
    assert cache_of(await message(paraphrase, "a", anthropic_beta=other)) == ("miss", None)
    assert cache_of(await message(paraphrase, "a", anthropic_beta=beta)) == ("hit", "semantic")
