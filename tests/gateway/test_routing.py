"""Routing through the whole gateway against mock upstreams on loopback that we make fail:
cost policy, tiers, aliases, fallback order, breakers, context-window fallback, and never a
retry after the first streamed byte."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest

from bench.common.mock_upstream import MockMode, MockServerThread
from tests.gateway.support import CHAT_MODEL as MODEL
from tests.gateway.support import (
    GatewayWorld,
    admin_key,
    assert_error,
    bearer,
    ok,
    priced_deployment,
    seed_tenant,
    serve_world,
)

MOCKS = ("a", "b", "big", "eco", "prem")
COOLDOWN_S = 3.0  # long enough that a loaded machine never sees it lapse by accident


@dataclass
class World(GatewayWorld):
    admin: dict[str, str]

    def requests(self, name: str) -> int:
        return self.mocks[name].mock.stats.requests

    async def deployment(self, name: str) -> dict[str, Any]:
        return ok(await self.client.get(f"/admin/deployments/{name}", headers=self.admin))


@pytest.fixture
async def world(sqlite_url, tmp_path, mocks: dict[str, MockServerThread]
                ) -> AsyncIterator[World]:
    deployments = [
        priced_deployment("a", mocks["a"], price="1", timeout_s=2),
        priced_deployment("b", mocks["b"], price="2"),
        priced_deployment("big", mocks["big"], price="5", context_window=100_000),
        priced_deployment("eco", mocks["eco"], price="0.5", model_name="eco-model",
                          tier="economy"),
        priced_deployment("prem", mocks["prem"], price="9", model_name="prem-model",
                          tier="premium"),
    ]
    aliases = [{"name": "b-first", "deployments": ["b", "a"], "policy": "ordered"}]
    admin = bearer(await admin_key(sqlite_url, tmp_path))
    async with serve_world(World, sqlite_url, tmp_path, mocks, deployments, aliases=aliases,
                           fields={"admin": admin}, breaker_failure_threshold=2,
                           breaker_window_s=30, breaker_cooldown_s=COOLDOWN_S,
                           route_max_attempts=3, route_budget_s=10) as w:
        yield w


def served_by(r: httpx.Response) -> tuple[str, int]:
    assert r.status_code == 200, r.text
    return r.headers["x-switchboard-deployment"], int(r.headers["x-switchboard-attempts"])


# --- policy -------------------------------------------------------------------------------


async def test_cheapest_healthy_deployment_serves(world):
    assert served_by(await world.chat()) == ("a", 1)
    assert ok(await world.chat())["model"] == "up-a"  # upstream answers pass through as sent


async def test_ordered_alias_follows_its_order(world):
    assert served_by(await world.chat(model="b-first")) == ("b", 1)
    world.mocks["b"].mock.mode = MockMode(status=500)
    assert served_by(await world.chat(model="b-first")) == ("a", 2)


async def test_auto_picks_by_tier(sqlite_url, tmp_path, world):
    # Every deployment may serve `auto`; the cheapest is the economy one.
    assert served_by(await world.chat(model="auto")) == ("eco", 1)
    # A request may ask for a tier.
    r = await world.chat(model="auto", headers={"x-switchboard-tier": "premium"})
    assert served_by(r) == ("prem", 1)
    r = await world.chat(model="auto", headers={"x-switchboard-tier": "standard"})
    assert served_by(r) == ("a", 1)
    r = await world.chat(model="auto", headers={"x-switchboard-tier": "gold"})
    assert_error(r, 400, code="tier_unavailable")
    # The plan sets the tiers a tenant may use.
    standard = await seed_tenant(sqlite_url, tmp_path, name="standard-only",
                                 plan={"allowed_tiers": ["standard"]})
    r = await world.chat(model="auto", key=standard.key)
    assert served_by(r) == ("a", 1)
    r = await world.chat(model="auto", key=standard.key,
                         headers={"x-switchboard-tier": "premium"})
    assert_error(r, 403, code="tier_not_allowed")
    r = await world.chat(model="prem-model", key=standard.key)
    assert_error(r, 403, code="tier_not_allowed")
    models = ok(await world.client.get("/v1/models", headers=bearer(standard.key)))
    assert [m["id"] for m in models["data"]] == [MODEL, "b-first", "auto"]


# --- fallbacks ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [
    MockMode(status=500), MockMode(status=503), MockMode(status=429, retry_after="7"),
    MockMode(drop=True), MockMode(delay_ms=4000),  # a's timeout is 2 s
], ids=["500", "503", "429", "dropped", "timeout"])
async def test_falls_back_to_the_next_deployment(world, mode):
    world.mocks["a"].mock.mode = mode
    assert served_by(await world.chat()) == ("b", 2)
    assert world.requests("a") == 1


async def test_every_deployment_failing_is_a_clear_error(world):
    for name in ("a", "b", "big"):
        world.mocks[name].mock.mode = MockMode(status=500)
    r = await world.chat()
    assert_error(r, 502, code="upstream_error")
    assert r.headers["x-switchboard-attempts"] == "3"
    assert [world.requests(n) for n in ("a", "b", "big")] == [1, 1, 1]


async def test_client_errors_are_not_retried(world):
    world.mocks["a"].mock.mode = MockMode(status=400)
    r = await world.chat()
    assert_error(r, 400, code="upstream_rejected")
    assert world.requests("b") == 0


async def test_the_total_time_is_bounded(sqlite_url, tmp_path, mocks):
    deployments = [priced_deployment(n, mocks[n], price=str(i + 1)) for i, n in
                   enumerate(("a", "b", "big"))]
    for name in ("a", "b", "big"):
        mocks[name].mock.mode = MockMode(delay_ms=3000)
    async with serve_world(GatewayWorld, sqlite_url, tmp_path, mocks, deployments,
                           route_budget_s=1.0) as w:
        started = time.monotonic()
        r = await w.chat()
        elapsed = time.monotonic() - started
    assert_error(r, 504, code="upstream_timeout")
    assert elapsed < 2.5
    assert r.headers["x-switchboard-attempts"] == "1"


# --- breakers -----------------------------------------------------------------------------


async def test_breaker_opens_probes_and_closes(world):
    world.mocks["a"].mock.mode = MockMode(status=500)
    for _ in range(2):
        assert served_by(await world.chat()) == ("b", 2)
    health = (await world.deployment("a"))["health"]
    assert health["breaker"]["state"] == "open" and health["breaker"]["times_opened"] == 1
    # Open: `a` is skipped without a request.
    assert served_by(await world.chat()) == ("b", 1)
    assert world.requests("a") == 2
    # After the cooldown one probe goes to `a`; it fails, so the breaker opens again.
    await asyncio.sleep(COOLDOWN_S + 0.1)
    assert (await world.deployment("a"))["health"]["breaker"]["state"] == "half_open"
    assert served_by(await world.chat()) == ("b", 2)
    assert world.requests("a") == 3
    assert (await world.deployment("a"))["health"]["breaker"]["times_opened"] == 2
    # `a` recovers: the next probe succeeds and closes the breaker.
    world.mocks["a"].mock.mode = MockMode()
    await asyncio.sleep(COOLDOWN_S + 0.1)
    assert served_by(await world.chat()) == ("a", 1)
    listed = ok(await world.client.get("/admin/deployments", headers=world.admin))
    states = {d["name"]: d["health"]["breaker"]["state"] for d in listed}
    assert states["a"] == "closed"
    assert all("api_key" not in d and "secret" not in json.dumps(d) for d in listed)


async def test_admin_resets_a_breaker(world):
    world.mocks["a"].mock.mode = MockMode(status=500)
    for _ in range(2):
        await world.chat()
    world.mocks["a"].mock.mode = MockMode()
    r = await world.client.post("/admin/deployments/a/breaker/reset", headers=world.admin)
    assert ok(r)["health"]["breaker"]["state"] == "closed"
    assert served_by(await world.chat()) == ("a", 1)


async def test_every_breaker_open_fails_fast(world):
    for name in ("a", "b", "big"):
        world.mocks[name].mock.mode = MockMode(status=500)
    for _ in range(2):
        await world.chat()
    before = sum(world.requests(n) for n in ("a", "b", "big"))
    r = await world.chat()
    assert_error(r, 503, code="no_healthy_deployment")
    assert int(r.headers["retry-after"]) >= 1
    assert sum(world.requests(n) for n in ("a", "b", "big")) == before


# --- context window -----------------------------------------------------------------------


async def test_long_prompts_go_to_a_larger_context_window(world):
    long = "word " * 9000  # about 11k tokens by the gateway's estimate: over 8192
    assert served_by(await world.chat(long)) == ("big", 1)
    assert world.requests("a") == world.requests("b") == 0


async def test_upstream_context_errors_move_to_a_larger_window(world):
    world.mocks["a"].mock.mode = MockMode(context_window=10)
    assert served_by(await world.chat("a prompt well over ten tokens " * 3)) == ("big", 2)
    assert world.requests("b") == 0  # same window as `a`: no use trying


async def test_a_prompt_too_long_for_every_window_is_a_400(world):
    r = await world.chat("word " * 90_000)
    assert_error(r, 400, code="context_length_exceeded")


# --- streams ------------------------------------------------------------------------------


async def test_stream_falls_back_before_the_first_byte(world):
    world.mocks["a"].mock.mode = MockMode(cut_after_events=0)
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=world.tenant.key,
                                http_client=world.client, max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert raw.headers["x-switchboard-deployment"] == "b"
    assert raw.headers["x-switchboard-attempts"] == "2"
    text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
    assert text == "Hello from the mock upstream."


async def test_never_retries_after_streamed_tokens(world):
    world.mocks["a"].mock.mode = MockMode(cut_after_events=3, chunk_delay_ms=20)
    async with world.client.stream("POST", "/v1/chat/completions", headers=bearer(world.tenant.key),
                                   json={"model": MODEL, "stream": True, "messages": [
                                       {"role": "user", "content": "hi"}]}) as r:
        assert r.headers["x-switchboard-deployment"] == "a"
        events = [line async for line in r.aiter_lines() if line.startswith("data:")]
    assert world.requests("b") == 0
    contents = [json.loads(e[5:]) for e in events]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in contents
                   if c.get("choices"))
    assert text == "Hello from"  # what `a` sent, and nothing from anyone else
    assert contents[-1]["error"]["code"] == "upstream_unreachable"


# --- litellm providers --------------------------------------------------------------------


async def test_litellm_deployments_route_and_fall_back(sqlite_url, tmp_path, mocks):
    deployments = [
        {"name": "via-litellm", "model_name": MODEL, "provider": "litellm",
         "upstream_model": "openai/mock-model", "base_url": mocks["a"].base_url,
         "api_key": "sk-litellm-secret", "input_price_per_1m": "1", "output_price_per_1m": "1"},
        priced_deployment("b", mocks["b"], price="2")]
    async with serve_world(GatewayWorld, sqlite_url, tmp_path, mocks, deployments) as w:
        r = await w.chat()
        assert served_by(r) == ("via-litellm", 1)
        assert r.json()["choices"][0]["message"]["content"] == "Hello from the mock upstream."
        assert mocks["a"].mock.last_request["headers"]["authorization"] == (
            "Bearer sk-litellm-secret")
        mocks["a"].mock.mode = MockMode(status=503)
        assert served_by(await w.chat()) == ("b", 2)
        mocks["a"].mock.mode = MockMode(status=429, retry_after="3")
        assert served_by(await w.chat()) == ("b", 2)


# --- admin edits --------------------------------------------------------------------------


async def test_admin_edits_prices_tiers_and_aliases_at_runtime(world):
    admin = world.admin
    r = await world.client.patch("/admin/deployments/b", headers=admin,
                                 json={"input_price_per_1m": "0.1", "output_price_per_1m": "0.1"})
    edited = ok(r)
    price = edited["price"]
    assert (price["input_per_1m"], price["output_per_1m"], price["source"]) == (
        "0.1", "0.1", "config")
    assert Decimal(price["cached_input_per_1m"]) == Decimal("0.05")  # half, unless set
    before = ok(await world.client.get("/admin/deployments/a", headers=admin))["price"]
    assert price["price_id"] and price["price_id"] != before["price_id"]  # a new version
    assert served_by(await world.chat()) == ("b", 1)  # now the cheapest

    bad = await world.client.patch("/admin/deployments/b", headers=admin, json={"weight": 0})
    assert_error(bad, 400)
    assert_error(await world.client.patch("/admin/deployments/nope", headers=admin,
                                          json={"weight": 2}), 404)

    alias = {"name": "big-first", "deployments": ["big", "a"], "policy": "ordered"}
    ok(await world.client.put("/admin/aliases/big-first", headers=admin, json=alias))
    assert served_by(await world.chat(model="big-first")) == ("big", 1)
    listed = ok(await world.client.get("/admin/aliases", headers=admin))
    assert {a["name"] for a in listed} == {"b-first", "big-first"}
    unknown = {"name": "x", "deployments": ["missing"]}
    assert_error(await world.client.put("/admin/aliases/x", headers=admin, json=unknown), 400)
    assert_error(await world.client.put("/admin/aliases/auto", headers=admin, json={
        "name": "auto", "deployments": ["a"]}), 400)
    ok(await world.client.delete("/admin/aliases/big-first", headers=admin))
    assert_error(await world.chat(model="big-first"), 404, code="model_not_found")

    # A tier edit takes effect for plans at once.
    ok(await world.client.patch("/admin/deployments/b", headers=admin,
                                json={"tier": "premium"}))
    r = await world.chat(headers={"x-switchboard-tier": "premium"})
    assert served_by(r) == ("b", 1)
