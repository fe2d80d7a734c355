"""RedisSemanticCache across replicas: sync, stale indexes, trimmed logs, Redis down."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial

import numpy as np
import pytest
from redis.asyncio import Redis

from caching.namespace import tenant_prefix
from caching.semantic import RedisSemanticCache
from tests.caching.support import DIM, cache_factory, e

Factory = Callable[..., RedisSemanticCache]


@pytest.fixture
async def replicas(redis: Redis, prefix: str) -> AsyncIterator[Factory]:
    """Each call is another gateway replica: same Redis, its own in-process index."""
    async with cache_factory(partial(RedisSemanticCache, redis, prefix=prefix, dim=DIM)) as factory:
        yield factory


async def value(cache: RedisSemanticCache, tenant: str, vector: np.ndarray) -> bytes | None:
    hit = await cache.lookup(tenant, "s", vector, threshold=0.99)
    return None if hit is None else hit.value


async def test_another_replica_sees_what_one_stored(replicas: Factory) -> None:
    one, two = replicas(), replicas()
    assert await value(two, "t1", e(0)) is None  # two loads the (empty) tenant first
    await one.store("t1", "s", e(0), b"from one", ttl_s=60)
    assert await value(two, "t1", e(0)) == b"from one"  # via the log
    fresh = replicas()
    assert await value(fresh, "t1", e(0)) == b"from one"  # via a first load
    assert (two.loads, fresh.loads) == (1, 1)


async def test_entry_deleted_in_redis_is_never_served_from_a_stale_index(
        replicas: Factory, redis: Redis, prefix: str) -> None:
    one, two = replicas(), replicas()
    await one.store("t1", "s", e(0), b"gone soon", ttl_s=60)
    await two.sync("t1")
    assert two.indexed("t1") == 1
    entries = [k async for k in redis.scan_iter(match=tenant_prefix(prefix, "s", "t1") + "e:*")]
    await redis.delete(*entries)  # as if Redis evicted it (maxmemory) behind our backs
    assert await value(two, "t1", e(0)) is None
    assert two.indexed("t1") == 0  # and the stale row is dropped


async def test_expired_entry_is_never_served(replicas: Factory) -> None:
    one, two = replicas(), replicas()
    await one.store("t1", "s", e(0), b"brief", ttl_s=0.15)
    assert await value(two, "t1", e(0)) == b"brief"
    await asyncio.sleep(0.25)
    assert await value(two, "t1", e(0)) is None
    assert two.indexed("t1") == 0


async def test_evictions_by_the_cap_reach_other_replicas(replicas: Factory) -> None:
    one, two = replicas(max_entries_per_tenant=2), replicas(max_entries_per_tenant=2)
    await two.sync("t1")
    for i in range(4):
        await one.store("t1", "s", e(i), f"v{i}".encode(), ttl_s=60)
        await asyncio.sleep(0.002)
    await two.sync("t1")
    assert two.indexed("t1") == 2
    assert [await value(two, "t1", e(i)) for i in range(4)] == [None, None, b"v2", b"v3"]
    assert two.loads == 1  # followed the log, no reload


async def test_a_replica_behind_a_trimmed_log_reloads(replicas: Factory, redis: Redis,
                                                     prefix: str) -> None:
    one, two = replicas(log_max_len=5), replicas(log_max_len=5, batch=50)
    await two.sync("t1")
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((300, DIM)).astype(np.float32)
    pipe_size = 50  # stores in flight at once; Redis trims the log in whole nodes of ~100
    for start in range(0, len(vectors), pipe_size):
        await asyncio.gather(*[one.store("t1", "s", vectors[i], f"v{i}".encode(), ttl_s=60)
                               for i in range(start, start + pipe_size)])
    log_length = await redis.xlen(tenant_prefix(prefix, "s", "t1") + "log")
    assert log_length < 300  # trimmed past what `two` saw
    assert await value(two, "t1", vectors[0]) == b"v0"
    assert await value(two, "t1", vectors[299]) == b"v299"
    assert two.loads == 2
    assert two.indexed("t1") == 300


async def test_a_load_skips_unreadable_entries(replicas: Factory, redis: Redis,
                                               prefix: str) -> None:
    one = replicas()
    await one.store("t1", "s", e(0), b"good", ttl_s=60)
    await one.store("t1", "s", e(1), b"bad", ttl_s=60)
    entry = tenant_prefix(prefix, "s", "t1") + "e:2"
    await redis.hset(entry, "vec", b"short")  # corrupted behind our backs
    fresh = replicas()
    assert await value(fresh, "t1", e(0)) == b"good"
    assert fresh.indexed("t1") == 1


async def test_tenant_keys_gone_resets_the_replica(replicas: Factory, redis: Redis,
                                                   prefix: str) -> None:
    one, two = replicas(), replicas()
    await one.store("t1", "s", e(0), b"old", ttl_s=60)
    await two.sync("t1")
    keys = [k async for k in redis.scan_iter(match=tenant_prefix(prefix, "s", "t1") + "*")]
    await redis.delete(*keys)  # everything expired; the counter starts over
    await one.store("t1", "s", e(1), b"new", ttl_s=60)
    assert await value(two, "t1", e(1)) == b"new"
    assert await value(two, "t1", e(0)) is None
    assert two.indexed("t1") == 1


async def test_concurrent_first_lookups_share_one_load(replicas: Factory) -> None:
    one, two = replicas(), replicas()
    await one.store("t1", "s", e(0), b"v", ttl_s=60)
    got = await asyncio.gather(*[value(two, "t1", e(0)) for _ in range(20)])
    assert got == [b"v"] * 20
    assert two.loads == 1


async def test_tenants_are_isolated_across_replicas(replicas: Factory, redis: Redis,
                                                    prefix: str) -> None:
    one, two = replicas(), replicas()
    await one.store("alpha", "s", e(0), b"alpha", ttl_s=60)
    assert await value(two, "beta", e(0)) is None
    assert two.indexed("beta") == 0
    keys = {k.decode() async for k in redis.scan_iter(match=f"{prefix}:*")}
    assert keys and all(k.startswith(tenant_prefix(prefix, "s", "alpha")) for k in keys)


async def test_redis_down_is_a_miss_and_a_no_op(dead_redis: Redis,
                                                caplog: pytest.LogCaptureFixture) -> None:
    cache = RedisSemanticCache(dead_redis, prefix="sbtest:down", dim=DIM, op_timeout_s=0.5,
                               first_load_wait_s=0.5)
    with caplog.at_level(logging.WARNING, logger="caching.semantic_redis"):
        for _ in range(3):
            await cache.store("t1", "s", e(0), b"v", ttl_s=60)
            assert await cache.lookup("t1", "s", e(0), threshold=0.5) is None
    assert cache.failures.count >= 6
    assert len([r for r in caplog.records if r.name == "caching.semantic_redis"]) == 1
    await cache.close()
    await dead_redis.aclose()


async def test_slow_first_load_goes_on_in_the_background(replicas: Factory) -> None:
    one = replicas()
    for i in range(DIM):
        await one.store("t1", "s", e(i), b"v", ttl_s=60)
    two = replicas(first_load_wait_s=0.0)
    assert await value(two, "t1", e(0)) is None  # did not wait for the load
    await two.sync("t1")
    assert await value(two, "t1", e(0)) == b"v"
    assert two.loads == 1
