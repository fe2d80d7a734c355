"""A worker's /stats poll: a busy worker that answers late stays routable for a few polls; one
that refuses the connection or answers with an error is out at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from decimal import Decimal

import aiohttp
import pytest
from aiohttp import web

from gateway.deployments import worker as worker_module
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.http_pool import HttpPool
from gateway.deployments.worker import SLOW_POLLS_BEFORE_DOWN, WorkerDeployment

READY = {"ready": True, "stats": {"num_waiting": 2, "num_running": 1}}


class StatsServer:
    """A loopback /stats whose answer can be made slow or an error."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.status = 200
        self.payload: dict[str, object] = READY
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, _: web.Request) -> web.Response:
        await asyncio.sleep(self.delay_s)
        return web.json_response(self.payload, status=self.status)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/stats", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def server() -> AsyncIterator[StatsServer]:
    s = StatsServer()
    await s.start()
    yield s
    await s.stop()


@pytest.fixture
async def pool() -> AsyncIterator[HttpPool]:
    p = HttpPool(max_connections=4)
    await p.open()
    yield p
    await p.close()


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "STATS_TIMEOUT", aiohttp.ClientTimeout(total=0.2))


def worker_at(port: int, pool: HttpPool) -> WorkerDeployment:
    config = DeploymentConfig(name="pool@w1", model_name="m", provider="worker",
                              base_url=f"http://127.0.0.1:{port}/v1",
                              input_price_per_1m=Decimal(0), output_price_per_1m=Decimal(0))
    return WorkerDeployment(config, pool)


async def test_a_late_answer_keeps_a_busy_worker_routable_until_it_repeats(server, pool):
    worker = worker_at(server.port, pool)
    await worker.poll()
    assert worker.accepting and worker.stats()["num_waiting"] == 2

    server.delay_s = 0.5  # past the timeout: a long step in flight
    for missed in range(1, SLOW_POLLS_BEFORE_DOWN):
        await worker.poll()
        assert worker.slow_polls == missed
        assert worker.accepting, f"out after {missed} late answer(s)"
    await worker.poll()
    assert not worker.accepting  # still late: gone

    server.delay_s = 0.0
    await worker.poll()
    assert worker.accepting and worker.slow_polls == 0


async def test_an_error_status_is_out_at_once(server, pool):
    worker = worker_at(server.port, pool)
    await worker.poll()
    assert worker.accepting
    server.status = 500
    await worker.poll()
    assert not worker.accepting


async def test_a_refused_connection_is_out_at_once(server, pool):
    worker = worker_at(server.port, pool)
    await worker.poll()
    assert worker.accepting
    await server.stop()
    server.runner = None
    await worker.poll()
    assert not worker.accepting
    await server.start()  # for the fixture's teardown


async def test_a_late_first_answer_does_not_make_a_worker_routable(server, pool):
    server.delay_s = 0.5
    worker = worker_at(server.port, pool)
    await worker.poll()
    assert not worker.accepting


@pytest.mark.parametrize(("stats", "room"), [
    ({"kv_hot_tokens": 1200, "kv_capacity_tokens": 4096}, (1200, 4096)),
    ({"kv_capacity_tokens": 4096}, None),  # prefix caching off: no working set
    ({"kv_hot_tokens": "many", "kv_capacity_tokens": 4096}, None),
    ({"kv_hot_tokens": 0, "kv_capacity_tokens": 0}, None),
])
async def test_the_kv_working_set_is_read_from_stats(server, pool, stats, room):
    server.payload = {"ready": True, "stats": {"num_waiting": 0, **stats}}
    w = worker_at(server.port, pool)
    assert w.kv_room() is None  # nothing polled yet
    await w.poll()
    assert w.kv_room() == room
