"""The embeddings route's work, bounded, paid and shared (issue 40): a request larger than the
bound is refused before any forward; a client that leaves pays for the inputs computed; a
request making progress is not cut by the route's deadline; and another tenant's request runs
beside a large one instead of after it. In-process, with the bundled all-MiniLM-L6-v2."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import pytest_asyncio
from sqlalchemy import text

from gateway.deployments.config import DeploymentConfig
from gateway.errors import APIError
from tenancy.db import make_engine
from tests.dbutil import migrated_database
from tests.gateway.support import (
    Seeded,
    assert_error,
    bearer,
    gateway_client,
    ok,
    seed_tenant,
    settings,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

MINILM = "all-minilm-l6-v2"


def ids(rows: int, length: int) -> list[list[int]]:
    """`rows` inputs of `length` token ids (each embeds `length` + 2 tokens)."""
    return [[2000 + (i * 7 + j) % 20000 for j in range(length)] for i in range(rows)]


@dataclass
class Work:
    client: httpx.AsyncClient
    db_url: str
    tenants: list[Seeded]

    @property
    def app(self) -> Any:
        return self.client._transport.app  # type: ignore[attr-defined]

    @property
    def deployment(self) -> Any:
        return self.app.state.gateway.deployments.get("embedded-embedding")

    async def embed(self, tenant: Seeded, inputs: Any) -> httpx.Response:
        return await self.client.post("/v1/embeddings", headers=bearer(tenant.key),
                                      json={"model": MINILM, "input": inputs})

    @contextmanager
    def slowed(self, seconds: float) -> Iterator[None]:
        """Every forward takes `seconds` and computes nothing (unit vectors): what these
        tests check is the route's and the batcher's, not the model's, and a busy CPU no
        longer matters."""
        batcher = self.deployment.batcher
        forward = batcher._forward

        async def slow(rows: list[list[int]]) -> Any:
            await asyncio.sleep(seconds)
            return np.full((len(rows), 384), 384 ** -0.5, dtype=np.float32)

        batcher._forward = slow
        try:
            yield
        finally:
            batcher._forward = forward

    async def usage(self, tenant: Seeded) -> list[tuple[Any, ...]]:
        gw = self.app.state.gateway
        await asyncio.gather(*gw.background)
        await gw.meter.flush()
        db = make_engine(self.db_url)
        try:
            async with db.connect() as conn:
                return list((await conn.execute(text(
                    "select status, prompt_tokens, cost_micros from usage_records "
                    "where tenant_id = :t"), {"t": tenant.tenant_id})).all())
        finally:
            await db.dispose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def work(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Work]:
    """One gateway for the module: a bound of 1000 tokens a request, forwards of 2 rows."""
    tmp = tmp_path_factory.mktemp("embedding-work")
    async with migrated_database("sqlite", tmp) as url:
        tenants = [await seed_tenant(url, tmp, name=name) for name in ("a", "b", "c", "d")]
        tenants.append(await seed_tenant(url, tmp, name="e",
                                         plan={"embedding_max_request_tokens": 300}))
        cfg = settings(url, tmp, embedding_model="default", embedding_max_request_tokens=1000,
                       embedding_max_batch_rows=2)
        async with gateway_client(cfg) as client:
            world = Work(client, url, tenants)
            ok(await world.embed(tenants[0], "warm up"))  # the first forward is the slowest
            yield world


async def leave_when(app: Any, key: str, body: dict[str, Any], ready: Any) -> list[dict]:
    """POST /v1/embeddings to the ASGI app directly; disconnect once `ready()` says so."""
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}
        for _ in range(3000):  # at most 30 s
            if ready():
                break
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/embeddings",
             "raw_path": b"/v1/embeddings", "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {key}".encode()),
                         (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 5000), "server": ("gateway", 80)}
    await app(scope, receive, send)
    return sent


async def test_a_request_over_the_bound_is_refused_before_any_forward(work: Work) -> None:
    tenant = work.tenants[0]
    before = work.deployment.batcher.forwards
    started = time.monotonic()
    error = assert_error(await work.embed(tenant, ids(4, 254)), 400,
                         code="embedding_work_exceeded")
    assert time.monotonic() - started < 5
    assert error["param"] == "input"
    assert "1024 tokens" in error["message"] and "at most 1000" in error["message"]
    assert work.deployment.batcher.forwards == before
    assert ok(await work.embed(tenant, ids(1, 254)))["usage"]["prompt_tokens"] == 256


async def test_a_plan_may_lower_the_bound(work: Work) -> None:
    bounded, free = work.tenants[4], work.tenants[0]
    error = assert_error(await work.embed(bounded, ids(2, 254)), 400,
                         code="embedding_work_exceeded")
    assert "512 tokens" in error["message"] and "at most 300" in error["message"]
    assert ok(await work.embed(free, ids(2, 254)))["usage"]["prompt_tokens"] == 512
    assert ok(await work.embed(bounded, ids(1, 254)))["usage"]["prompt_tokens"] == 256


async def test_an_upstream_is_bounded_where_its_config_says() -> None:
    """On the estimate (4 characters a token), before anything is sent."""
    from gateway.deployments.embedding import HttpEmbeddingDeployment
    from gateway.deployments.http_pool import HttpPool
    from gateway.schemas.embeddings import EmbeddingRequest

    config = DeploymentConfig(name="up", model_name="remote", provider="openai",
                              mode="embedding", base_url="http://127.0.0.1:9/v1",
                              max_request_tokens=100)
    upstream = HttpEmbeddingDeployment(config, HttpPool(max_connections=1))
    request = EmbeddingRequest.model_validate({"model": "remote", "input": ["x" * 400] * 2})
    with pytest.raises(APIError) as caught:
        upstream.prepare_embedding(request)
    assert caught.value.code == "embedding_work_exceeded" and "about 202" in caught.value.message
    unbounded = HttpEmbeddingDeployment(
        config.model_copy(update={"max_request_tokens": None}), HttpPool(max_connections=1))
    assert unbounded.prepare_embedding(request).prompt_tokens == 202


async def test_a_client_that_leaves_pays_for_the_inputs_computed(work: Work) -> None:
    tenant = work.tenants[1]
    batcher = work.deployment.batcher
    before = batcher.forwards
    body = {"model": MINILM, "input": ids(12, 64)}  # 6 forwards of two 66-token rows
    with work.slowed(0.05):
        sent = await leave_when(work.app, tenant.key, body,
                                lambda: batcher.forwards >= before + 2)
    assert sent[0]["status"] == 499
    ((status, prompt_tokens, cost),) = await work.usage(tenant)
    assert status == "aborted"
    # the rows computed, and those whose forward was running: never 0, never all 12
    assert prompt_tokens % 66 == 0 and 4 * 66 <= prompt_tokens < 12 * 66
    assert cost > 0


async def test_a_request_making_progress_outlives_the_route_deadline(work: Work) -> None:
    fallbacks = work.app.state.gateway.fallbacks
    budget, fallbacks.budget_s = fallbacks.budget_s, 0.5  # route_budget_s
    try:
        with work.slowed(0.1):
            started = time.monotonic()
            body = ok(await work.embed(work.tenants[2], ids(16, 6)))
    finally:
        fallbacks.budget_s = budget
    assert time.monotonic() - started > 0.8  # 8 forwards of 0.1 s at least; the route's 0.5
    assert len(body["data"]) == 16 and body["usage"]["prompt_tokens"] == 16 * 8


async def test_another_tenant_runs_beside_a_large_request(work: Work) -> None:
    large, small = work.tenants[3], work.tenants[0]
    batcher = work.deployment.batcher
    tokens = dict(work.deployment.tenant_tokens())
    with work.slowed(0.05):
        before = batcher.forwards
        big = asyncio.ensure_future(work.embed(large, ids(40, 6)))  # 20 forwards of 2 rows
        while batcher.forwards < before + 1:
            await asyncio.sleep(0.005)
        arrived = batcher.forwards
        one = ok(await work.embed(small, "one short string"))
        assert len(one["data"]) == 1
        assert not big.done() and batcher.forwards - arrived <= 2
        assert len(ok(await big)["data"]) == 40
    after = work.deployment.tenant_tokens()
    assert after[large.tenant_id] - tokens.get(large.tenant_id, 0) == 40 * 8
    assert after[small.tenant_id] - tokens[small.tenant_id] == 5


async def test_a_request_the_route_times_out_pays_for_its_running_forward(work: Work) -> None:
    """Cut before its first forward ends (the only time the deadline can cut it): the rows
    of that forward are computed all the same, and billed."""
    tenant = work.tenants[2]
    fallbacks = work.app.state.gateway.fallbacks
    budget, fallbacks.budget_s = fallbacks.budget_s, 0.1
    try:
        with work.slowed(0.4):
            assert_error(await work.embed(tenant, ids(6, 6)), 504, code="upstream_timeout")
    finally:
        fallbacks.budget_s = budget
    cut = [row for row in await work.usage(tenant) if row[0] != "ok"]
    assert [(status, tokens) for status, tokens, _ in cut] == [("error", 2 * 8)]
    assert cut[0][2] > 0
