"""The billing issue's test: kill -9 a live gateway under load, restart it, and every response
that completed has exactly one usage record. SIGTERM under load loses nothing either, and
leaves an empty outbox.

The flush interval is long (30 s), so most records are only in the outbox when the kill comes;
the restart replays them.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from billing.models import UsageDaily
from tenancy.db import make_engine
from tenancy.models import UsageRecord
from tests.dbutil import BACKENDS, migrated_database
from tests.e2e.support import Gateway, gateway_env
from tests.gateway.support import (
    MockUpstream,
    Seeded,
    mock_deployment,
    seed_tenant,
    write_deployments,
)

WORKERS = 8
LOAD_S = 2.0
SIGNAL_AFTER_S = 1.2  # mid-load
RECORDS_TIMEOUT_S = 30.0
# uvicorn re-raises SIGTERM once its graceful shutdown (lifespan included) is done.
CLEAN_EXIT = (0, -signal.SIGTERM)


async def load(url: str, key: str, *, until: asyncio.Event) -> list[str]:
    """WORKERS clients sending chat completions (half streamed, some cacheable) until `until`
    is set or LOAD_S passes; the request ids of the responses that arrived complete."""
    completed: list[str] = []
    numbers = itertools.count()
    deadline = time.monotonic() + LOAD_S

    async def one(client: httpx.AsyncClient, n: int) -> None:
        stream = n % 2 == 0
        text = "same question" if n % 4 == 1 else f"question {n}"  # some exact-cache hits
        body = {"model": "mock-model", "messages": [{"role": "user", "content": text}],
                "max_tokens": 8, "stream": stream}
        headers = {"authorization": f"Bearer {key}"}
        if not stream:
            r = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            if r.status_code == 200 and r.json().get("choices"):
                completed.append(r.headers["x-request-id"])
            return
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers=headers) as r:
            if r.status_code != 200:
                return
            async for line in r.aiter_lines():
                if line.strip() == "data: [DONE]":
                    completed.append(r.headers["x-request-id"])

    async def worker(client: httpx.AsyncClient) -> None:
        while not until.is_set() and time.monotonic() < deadline:
            try:
                await one(client, next(numbers))
            except httpx.HTTPError:  # the gateway died or is stopping under us
                await asyncio.sleep(0.01)

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(worker(client) for _ in range(WORKERS)))
    return completed


async def load_and_signal(gateway: Gateway, key: str, signum: int) -> list[str]:
    until = asyncio.Event()
    running = asyncio.create_task(load(gateway.url, key, until=until))
    await asyncio.sleep(SIGNAL_AFTER_S)
    gateway.signal(signum)
    await asyncio.to_thread(gateway.wait)
    until.set()
    return await running


async def stored_ids(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as conn:
        return list((await conn.scalars(select(UsageRecord.request_id))).all())


async def wait_for_records(engine: AsyncEngine, completed: list[str]) -> list[str]:
    deadline = time.monotonic() + RECORDS_TIMEOUT_S
    while True:
        ids = await stored_ids(engine)
        if set(completed) <= set(ids) or time.monotonic() > deadline:
            return ids
        await asyncio.sleep(0.2)


async def assert_exactly_once(engine: AsyncEngine, completed: list[str], gateway: Gateway
                              ) -> None:
    ids = await wait_for_records(engine, completed)
    missing = set(completed) - set(ids)
    assert not missing, (f"{len(missing)} of {len(completed)} completed responses have no "
                         f"usage record\n{gateway.log_tail()}")
    assert len(ids) == len(set(ids)), "a usage record was written twice"
    assert len(completed) == len(set(completed))
    async with engine.connect() as conn:
        counted = await conn.scalar(select(func.coalesce(func.sum(UsageDaily.requests), 0)))
    assert counted == len(ids), "the daily aggregates counted a replayed record twice"


def outbox_files(directory: Path) -> list[str]:
    """Segment files, in the per-database folder the gateway keeps under the outbox dir."""
    return sorted(p.name for p in directory.rglob("*") if p.is_file())


@pytest.fixture(params=BACKENDS)
async def live(request: pytest.FixtureRequest, tmp_path: Path
               ) -> AsyncIterator[tuple[dict[str, str], Seeded, AsyncEngine, Path]]:
    """The environment of a gateway on a fresh database with a mock upstream, a tenant with
    no limits, an engine on the same database, and the outbox directory."""
    upstream = MockUpstream().start()
    try:
        async with migrated_database(request.param, tmp_path) as db_url:
            tenant = await seed_tenant(db_url, tmp_path, name="loaded")
            outbox = tmp_path / "outbox"
            env = gateway_env(  # no Redis: the in-process limiter
                db_url, tmp_path, usage_outbox_dir=outbox, usage_flush_interval_s=30,
                deployments_file=write_deployments(
                    tmp_path, [mock_deployment(upstream.base_url)]))
            engine = make_engine(db_url)
            try:
                yield env, tenant, engine, outbox
            finally:
                await engine.dispose()
    finally:
        upstream.stop()


@pytest.fixture
def gateways(live: tuple[dict[str, str], Seeded, AsyncEngine, Path], tmp_path: Path
             ) -> Iterator[tuple[Gateway, Gateway]]:
    """The gateway under load, started, and the one that restarts after it (not yet started),
    on the same environment and log; both are killed at the end if they still run."""
    env = live[0]
    gateway = Gateway(env, tmp_path / "gateway.log")
    restarted = Gateway(env, tmp_path / "gateway.log")
    try:
        yield gateway.start(), restarted
    finally:
        gateway.stop()
        restarted.stop()


async def restart_and_drain(restarted: Gateway, engine: AsyncEngine, completed: list[str],
                            outbox: Path) -> None:
    """Start the successor (it replays any segments first): every completed response has
    exactly one record; then its own SIGTERM is a clean exit that leaves the outbox empty."""
    restarted.start()
    await assert_exactly_once(engine, completed, restarted)
    restarted.signal(signal.SIGTERM)
    assert restarted.wait() in CLEAN_EXIT
    assert outbox_files(outbox) == []


async def test_kill9_under_load_loses_no_completed_response(live, gateways):
    _, tenant, engine, outbox = live
    gateway, restarted = gateways
    completed = await load_and_signal(gateway, tenant.key, signal.SIGKILL)
    assert gateway.wait() == -signal.SIGKILL
    assert len(completed) >= 20, gateway.log_tail()
    # The test means something only if the kill caught records in the outbox alone.
    assert outbox_files(outbox), "no outbox segment: is the meter given outbox_dir?"
    assert len(set(await stored_ids(engine)) & set(completed)) < len(completed), (
        "every record was already in the database: the kill tested nothing")
    await restart_and_drain(restarted, engine, completed, outbox)


async def test_sigterm_under_load_drains_everything(live, gateways):
    _, tenant, engine, outbox = live
    gateway, restarted = gateways
    completed = await load_and_signal(gateway, tenant.key, signal.SIGTERM)
    assert gateway.wait() in CLEAN_EXIT, gateway.log_tail()
    assert len(completed) >= 20, gateway.log_tail()
    assert outbox_files(outbox) == [], gateway.log_tail()  # a clean stop leaves nothing
    assert set(completed) <= set(await stored_ids(engine))  # written before it exited
    await restart_and_drain(restarted, engine, completed, outbox)
