"""What the gateway meters, on SQLite and PostgreSQL: one record per admitted request with the
token counts the client was told, costs priced per part at the recorded price version, and the
right deployment, tier and status for streams, fallbacks, failures and markups."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import select

from bench.common.mock_upstream import MockMode, MockServerThread, MockStats
from billing.models import PriceVersion, UsageDaily
from gateway.app import create_app
from tenancy.db import make_engine, make_sessionmaker
from tenancy.models import UsageRecord
from tests.dbutil import BACKENDS, migrated_database
from tests.gateway.support import Seeded, bearer, in_process, seed_tenant, settings

MODEL = "chat"


@pytest.fixture(params=BACKENDS)
async def db_url(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[str]:
    async with migrated_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(scope="module")
def mocks() -> Iterator[dict[str, MockServerThread]]:
    servers = {name: MockServerThread().start() for name in ("a", "b")}
    yield servers
    for server in servers.values():
        server.stop()


@dataclass
class World:
    client: httpx.AsyncClient
    db_url: str
    plain: Seeded
    marked_up: Seeded
    mocks: dict[str, MockServerThread]
    app: Any

    async def chat(self, tenant: Seeded, **extra: Any) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi to me"}],
                **extra}
        return await self.client.post("/v1/chat/completions", json=body, headers={
            **bearer(tenant.key), "x-switchboard-cache": "off"})

    async def rows(self) -> list[UsageRecord]:
        await self.app.state.gateway.meter.flush()
        engine = make_engine(self.db_url)
        try:
            async with make_sessionmaker(engine)() as session:
                return list(await session.scalars(select(UsageRecord).order_by(UsageRecord.id)))
        finally:
            await engine.dispose()

    async def table(self, model: type[Any]) -> list[Any]:
        engine = make_engine(self.db_url)
        try:
            async with make_sessionmaker(engine)() as session:
                return list(await session.scalars(select(model)))
        finally:
            await engine.dispose()


@pytest.fixture
async def world(db_url, tmp_path, mocks) -> AsyncIterator[World]:
    for server in mocks.values():
        server.mock.mode = MockMode()
        server.mock.stats = MockStats()
    routing = {"deployments": [
        {"name": "a", "model_name": MODEL, "provider": "openai", "base_url": mocks["a"].base_url,
         "tier": "economy", "input_price_per_1m": "3", "output_price_per_1m": "7",
         "cached_input_price_per_1m": "1"},
        {"name": "b", "model_name": MODEL, "provider": "openai", "base_url": mocks["b"].base_url,
         "tier": "economy", "input_price_per_1m": "5", "output_price_per_1m": "11"}]}
    path = tmp_path / "routing.yaml"
    path.write_text(yaml.safe_dump(routing))
    plain = await seed_tenant(db_url, tmp_path, name="plain")
    marked_up = await seed_tenant(db_url, tmp_path, name="marked",
                                  plan={"price_markup_bp": 2500})
    app = create_app(settings(db_url, tmp_path, deployments_file=path))
    async with in_process(app) as client:
        yield World(client, db_url, plain, marked_up, mocks, app)


async def test_plain_and_streamed_answers_are_metered_as_answered(world):
    plain = await world.chat(world.plain, max_tokens=3)
    usage = plain.json()["usage"]
    streamed = await world.chat(world.plain, stream=True,
                                stream_options={"include_usage": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    stream_usage = events[-1]["usage"]
    hidden = await world.chat(world.plain, stream=True)  # usage not asked: still metered
    assert '"usage":{' not in hidden.text

    first, second, third = await world.rows()
    assert [r.request_id for r in (first, second, third)] == [
        r.headers["x-request-id"] for r in (plain, streamed, hidden)]
    assert (first.prompt_tokens, first.completion_tokens) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert (second.prompt_tokens, second.completion_tokens) == (
        stream_usage["prompt_tokens"], stream_usage["completion_tokens"])
    assert (third.prompt_tokens, third.completion_tokens) == (
        second.prompt_tokens, second.completion_tokens)
    for row in (first, second, third):
        assert (row.status, row.deployment, row.tier, row.cache_hit) == (
            "ok", "a", "economy", "none")
        # Priced per part at deployment a's rates (micro-USD per token), rounded up.
        assert row.input_cost_micros == 3 * row.prompt_tokens
        assert row.output_cost_micros == 7 * row.completion_tokens
        assert row.cached_cost_micros == 0
        assert row.cost_micros == row.input_cost_micros + row.output_cost_micros
        assert row.total_ms is not None and row.total_ms >= row.ttft_ms >= row.queue_ms >= 0
        assert row.started_at <= row.created_at
    versions = {v.id: v for v in await world.table(PriceVersion)}
    version = versions[first.price_id]
    assert (version.deployment, version.input_per_1m, version.output_per_1m,
            version.cached_input_per_1m) == ("a", Decimal(3), Decimal(7), Decimal(1))
    [daily] = await world.table(UsageDaily)
    assert (daily.requests, daily.prompt_tokens, daily.cost_micros) == (
        3, sum(r.prompt_tokens for r in (first, second, third)),
        sum(r.cost_micros for r in (first, second, third)))


async def test_a_fallback_is_one_record_for_the_deployment_that_answered(world):
    world.mocks["a"].mock.mode = MockMode(status=503)
    r = await world.chat(world.plain)
    assert r.headers["x-switchboard-deployment"] == "b"
    [row] = await world.rows()
    assert (row.deployment, row.status) == ("b", "ok")
    assert row.input_cost_micros == 5 * row.prompt_tokens
    assert row.output_cost_micros == 11 * row.completion_tokens
    assert row.completion_tokens == r.json()["usage"]["completion_tokens"]


async def test_failures_are_metered_at_no_cost(world):
    for server in world.mocks.values():
        server.mock.mode = MockMode(status=500)
    r = await world.chat(world.plain)
    assert r.status_code == 502
    [row] = await world.rows()
    assert (row.status, row.prompt_tokens, row.completion_tokens, row.cost_micros) == (
        "error", 0, 0, 0)
    assert row.request_id == r.headers["x-request-id"]


async def test_the_plan_markup_applies_to_every_part(world):
    base = await world.chat(world.plain)
    marked = await world.chat(world.marked_up)
    assert base.json()["usage"] == marked.json()["usage"]
    plain_row, marked_row = await world.rows()
    assert marked_row.input_cost_micros == -(-plain_row.input_cost_micros * 125 // 100)
    assert marked_row.output_cost_micros == -(-plain_row.output_cost_micros * 125 // 100)
    assert marked_row.price_id == plain_row.price_id  # the same price version, marked up
