"""Per-source backoff on authentication failures: the table alone (a fake clock), then bearer
keys and console sign-ins through the app."""

from __future__ import annotations

import re

import httpx

from gateway.app import create_app
from gateway.auth_throttle import FORGET_AFTER_S, FailureThrottle
from tests.gateway.support import admin_key, bearer, in_process, seed_tenant, settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_after_the_free_failures_and_is_capped():
    clock = Clock()
    throttle = FailureThrottle(free=2, max_s=5, max_sources=100, clock=clock)
    waits = []
    for _ in range(6):
        throttle.failed("a")
        waits.append(throttle.retry_after("a"))
    assert waits == [0, 0, 1, 2, 4, 5]
    assert throttle.retry_after("b") == 0  # per source
    clock.now += 5
    assert throttle.retry_after("a") == 0  # served its time; the next failure waits again
    throttle.failed("a")
    assert throttle.retry_after("a") == 5
    throttle.succeeded("a")
    assert throttle.retry_after("a") == 0


def test_quiet_sources_are_forgotten_and_the_table_is_bounded():
    clock = Clock()
    throttle = FailureThrottle(free=1, max_s=60, max_sources=3, clock=clock)
    for _ in range(3):
        throttle.failed("a")
    clock.now += FORGET_AFTER_S + 1
    throttle.failed("a")  # starts again from zero: within the free failures
    assert throttle.retry_after("a") == 0
    for i in range(10):
        throttle.failed(f"s{i}")
    assert len(throttle) == 3


def client_at(app, host: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


async def test_bearer_failures_are_throttled_per_source(sqlite_url, tmp_path):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="thr")
    app = create_app(settings(sqlite_url, tmp_path, auth_failures_free=3))
    async with in_process(app), client_at(app, "10.0.0.1") as bad, \
            client_at(app, "10.0.0.2") as good:
        wrong = bearer(tenant.key[:-4] + "0000")
        statuses = [(await bad.get("/v1/models", headers=wrong)).status_code for _ in range(5)]
        refused = await bad.get("/v1/models", headers=bearer(tenant.key))
        other = await good.get("/v1/models", headers=bearer(tenant.key))
        probe = await bad.get("/health/live")
    assert statuses == [401, 401, 401, 401, 429]
    assert refused.status_code == 429  # closed out: not even a right key is looked at
    assert refused.json()["error"]["code"] == "too_many_auth_failures"
    assert int(refused.headers["retry-after"]) >= 1
    assert other.status_code == 200  # another source is unaffected
    assert probe.status_code == 200  # probes are never throttled


async def test_loopback_sources_are_not_throttled(sqlite_url, tmp_path):
    app = create_app(settings(sqlite_url, tmp_path, auth_failures_free=1))
    async with in_process(app), client_at(app, "127.0.0.1") as local:
        statuses = {(await local.get("/v1/models", headers=bearer("sk-sb-x-y"))).status_code
                    for _ in range(4)}
    assert statuses == {401}


async def test_console_sign_in_failures_are_throttled(sqlite_url, tmp_path):
    await admin_key(sqlite_url, tmp_path)
    app = create_app(settings(sqlite_url, tmp_path, auth_failures_free=2))
    async with in_process(app), client_at(app, "10.0.0.3") as browser:
        page = await browser.get("/console/login")
        statuses = []
        for _ in range(4):  # each refusal renders the form again, with a fresh token
            token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
            assert token is not None
            page = await browser.post("/console/login", data={
                "csrf_token": token[1], "key": "sk-sb-admin-nope-0000", "next": ""})
            statuses.append(page.status_code)
            if page.status_code == 429:
                break
    assert statuses == [401, 401, 401, 429]
