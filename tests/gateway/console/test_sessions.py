"""Console session stores: in process (the embedded default) and Redis (shared by replicas).

The Redis tests use the real server at 127.0.0.1:6379 (a missing server fails them), each
under its own key prefix, removed afterwards.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis.asyncio as redis

from gateway.console.redis_sessions import RedisSessionStore
from gateway.console.sessions import (
    ConsoleSessions,
    SessionStore,
    SessionStoreUnavailable,
    digest,
    make_session_store,
)
from tenancy import service
from tenancy.db import make_engine, make_sessionmaker
from tests.gateway.console.support import console

REDIS_URL = "redis://127.0.0.1:6379/0"
DEAD_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: connection refused

Factory = Callable[..., ConsoleSessions]


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    name = f"sb:test:console:{secrets.token_hex(6)}"
    yield name
    client = redis.from_url(REDIS_URL)
    try:
        async for key in client.scan_iter(match=f"{name}:*"):
            await client.delete(key)
    finally:
        await client.aclose()


@pytest.fixture(params=["memory", "redis"])
async def make_store(request: pytest.FixtureRequest, prefix: str
                     ) -> AsyncIterator[Factory]:
    """Builds stores of one kind; Redis stores made by one test share the prefix, as
    replicas share a Redis."""
    made: list[ConsoleSessions] = []
    shared_memory: dict[tuple[float, int], SessionStore] = {}

    def build(*, ttl_s: float = 60.0, max_sessions: int = 100) -> ConsoleSessions:
        store: ConsoleSessions
        if request.param == "memory":  # one process: "another replica" is the same store
            store = shared_memory.setdefault((ttl_s, max_sessions), SessionStore(
                ttl_s=ttl_s, max_sessions=max_sessions))
        else:
            store = RedisSessionStore(REDIS_URL, ttl_s=ttl_s, max_sessions=max_sessions,
                                      timeout_s=2.0, prefix=prefix)
        made.append(store)
        return store

    yield build
    for store in made:
        await store.close()


async def redis_keys(prefix: str) -> dict[str, str]:
    client = redis.from_url(REDIS_URL, decode_responses=True)
    try:
        found = {}
        async for key in client.scan_iter(match=f"{prefix}:*"):
            kind = await client.type(key)
            found[key] = (await client.get(key) if kind == "string"
                          else str(await client.zrange(key, 0, -1)))
        return found
    finally:
        await client.aclose()


async def test_create_get_delete(make_store):
    store = make_store()
    session_id, session = await store.create(admin_key_id="k1", admin_name="ops")
    assert len(session_id) >= 43 and session.csrf_token != session_id
    got = await store.get(session_id)
    assert got == session and got.admin_key_id == "k1" and got.admin_name == "ops"
    assert await store.get(None) is None and await store.get("") is None
    assert await store.get(session_id + "x") is None
    await store.delete(session_id)
    assert await store.get(session_id) is None
    await store.delete(session_id)  # twice is harmless
    await store.delete(None)


async def test_a_session_made_on_one_replica_is_known_to_the_others(make_store):
    one, two = make_store(), make_store()
    session_id, session = await one.create(admin_key_id="k1", admin_name="ops")
    assert await two.get(session_id) == session
    await two.delete(session_id)  # signing out on another replica ends it everywhere
    assert await one.get(session_id) is None


async def test_sessions_expire(make_store):
    store = make_store(ttl_s=0.3)
    session_id, _ = await store.create(admin_key_id="k1", admin_name="ops")
    assert await store.get(session_id) is not None
    await asyncio.sleep(0.5)
    assert await store.get(session_id) is None


async def test_revoking_an_admin_key_ends_its_sessions_on_every_replica(make_store):
    one, two = make_store(), make_store()
    a1, _ = await one.create(admin_key_id="revoked", admin_name="a")
    a2, _ = await two.create(admin_key_id="revoked", admin_name="a")
    other, _ = await one.create(admin_key_id="kept", admin_name="b")
    assert await two.end_admin("revoked") == 2
    assert await one.get(a1) is None and await one.get(a2) is None
    assert await two.get(other) is not None
    assert await one.end_admin("revoked") == 0
    assert await one.end_admin("never-signed-in") == 0


async def test_the_oldest_sessions_go_over_the_cap(make_store):
    store = make_store(max_sessions=3)
    ids = []
    for _ in range(5):
        session_id, _ = await store.create(admin_key_id="k1", admin_name="ops")
        ids.append(session_id)
        await asyncio.sleep(0.002)  # distinct expiry times: the order is well defined
    assert [await store.get(i) is not None for i in ids] == [False, False, True, True, True]


async def test_redis_keeps_only_digests_with_the_session_lifetime(prefix):
    store = RedisSessionStore(REDIS_URL, ttl_s=600, prefix=prefix)
    try:
        session_id, session = await store.create(admin_key_id="k1", admin_name="ops")
        keys = await redis_keys(prefix)
        assert set(keys) == {f"{prefix}:s:{digest(session_id)}", f"{prefix}:a:k1"}
        assert all(session_id not in k and session_id not in v for k, v in keys.items())
        assert session.csrf_token in keys[f"{prefix}:s:{digest(session_id)}"]
        client = redis.from_url(REDIS_URL)
        try:
            for key in keys:
                ttl_ms = await client.pttl(key)
                assert 590_000 < ttl_ms <= 600_000, (key, ttl_ms)
        finally:
            await client.aclose()
        await store.delete(session_id)
        assert await redis_keys(prefix) == {}  # an emptied sorted set is no key at all
    finally:
        await store.close()


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A Redis URL whose server accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


@pytest.mark.parametrize("url_kind", ["refused", "silent"])
async def test_redis_down_or_silent_fails_closed_within_the_timeout(url_kind, silent_server):
    url = DEAD_URL if url_kind == "refused" else silent_server
    store = RedisSessionStore(url, ttl_s=60, timeout_s=0.3)
    try:
        started = time.monotonic()
        assert await store.get("any-session-id") is None  # not signed in
        with pytest.raises(SessionStoreUnavailable):
            await store.create(admin_key_id="k1", admin_name="ops")
        assert await store.end_admin("k1") == 0
        await store.delete("any-session-id")
        assert time.monotonic() - started < 4 * 0.3 + 1.0  # each call bounded by the timeout
    finally:
        await store.close()


def test_the_settings_pick_the_store():
    memory = make_session_store(redis_url="", ttl_s=5, max_sessions=7, timeout_s=1)
    assert isinstance(memory, SessionStore) and memory.max_sessions == 7
    shared = make_session_store(redis_url=REDIS_URL, ttl_s=5, max_sessions=7, timeout_s=0.5)
    assert isinstance(shared, RedisSessionStore) and shared.timeout_s == 0.5
    with pytest.raises(ValueError):
        make_session_store(redis_url="http://127.0.0.1:6379", ttl_s=5, max_sessions=7,
                           timeout_s=1)


# -- the console over two in-process apps on one database and one Redis ---------------------


async def test_a_console_sign_in_holds_on_another_replica(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path, redis_url=REDIS_URL) as one, \
            console(sqlite_url, tmp_path, redis_url=REDIS_URL, login=False) as two:
        key_id = one.admin.split("-")[3]
        try:
            cookie = one.client.cookies.get("sb_console")
            assert cookie
            two.client.cookies.set("sb_console", cookie)
            assert (await two.client.get("/console/tenants")).status_code == 200
            # A change on replica two, with the CSRF token of the session made on one.
            r = await two.client.post("/console/tenants",
                                      data={"csrf_token": one.csrf, "name": "from-two",
                                            "plan_id": "__new__"})
            assert r.status_code == 303, r.text
            assert "from-two" in (await one.client.get("/console/tenants")).text
            # Signing out on replica two ends the session on replica one.
            r = await two.client.post("/console/logout", data={"csrf_token": one.csrf})
            assert r.status_code == 303
            assert (await one.client.get("/console/tenants")).status_code == 303
        finally:
            await one.app.state.gateway.console_sessions.end_admin(key_id)


async def test_revoking_the_admin_key_on_one_replica_signs_out_everywhere(sqlite_url,
                                                                         tmp_path):
    async with console(sqlite_url, tmp_path, redis_url=REDIS_URL) as one, \
            console(sqlite_url, tmp_path, redis_url=REDIS_URL, login=False) as two:
        key_id = one.admin.split("-")[3]
        two.client.cookies.set("sb_console", one.client.cookies.get("sb_console"))
        try:
            assert (await two.client.get("/console/tenants")).status_code == 200
            engine = make_engine(sqlite_url)
            try:
                async with make_sessionmaker(engine)() as session:
                    assert await service.revoke_admin_key(session, key_id=key_id)
            finally:
                await engine.dispose()
            r = await two.client.get("/console/tenants")
            assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
            store = one.app.state.gateway.console_sessions
            assert isinstance(store, RedisSessionStore)
            assert await store.get(one.client.cookies.get("sb_console")) is None
            assert (await one.client.get("/console/tenants")).status_code == 303
        finally:
            await one.app.state.gateway.console_sessions.end_admin(key_id)


async def test_the_console_fails_closed_when_redis_is_down(sqlite_url, tmp_path):
    # The limiter may fail open; the console never does.
    async with console(sqlite_url, tmp_path, login=False, redis_url=DEAD_URL,
                       redis_fail_open=True, redis_timeout_s=0.3) as c:
        r = await c.login()
        assert r.status_code == 503 and "unavailable" in r.text
        assert not [v for k, v in r.headers.multi_items()
                    if k == "set-cookie" and v.startswith("sb_console=")]
        c.client.cookies.set("sb_console", "a-cookie-from-before-the-outage")
        r = await c.client.get("/console/tenants")
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
