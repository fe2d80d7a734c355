"""Exact caches on both backends: hits, expiry, caps, tenant isolation, failures as misses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from caching.exact import ExactCache, MemoryExactCache, RedisExactCache
from caching.namespace import tenant_prefix, tenant_tag

Factory = Callable[..., ExactCache]


@pytest.fixture(params=["memory", "redis"])
async def make_cache(request: pytest.FixtureRequest, redis: Redis,
                     prefix: str) -> AsyncIterator[Factory]:
    made: list[ExactCache] = []

    def factory(**kwargs: int) -> ExactCache:
        cache: ExactCache
        if request.param == "memory":
            cache = MemoryExactCache(**kwargs)
        else:
            cache = RedisExactCache(redis, prefix=prefix, **kwargs)
        made.append(cache)
        return cache

    yield factory
    for cache in made:
        await cache.close()


async def test_hit_and_miss(make_cache: Factory) -> None:
    cache = make_cache()
    assert await cache.get("t1", "k") is None
    await cache.put("t1", "k", b'{"answer": 1}', ttl_s=60)
    assert await cache.get("t1", "k") == b'{"answer": 1}'
    assert await cache.get("t1", "other") is None
    await cache.put("t1", "k", b"replaced", ttl_s=60)
    assert await cache.get("t1", "k") == b"replaced"


async def test_same_key_under_two_tenants_never_crosses(make_cache: Factory) -> None:
    cache = make_cache()
    await cache.put("alpha", "k", b"alpha's answer", ttl_s=60)
    assert await cache.get("beta", "k") is None
    await cache.put("beta", "k", b"beta's answer", ttl_s=60)
    assert await cache.get("alpha", "k") == b"alpha's answer"
    assert await cache.get("beta", "k") == b"beta's answer"


async def test_tenant_ids_that_could_collide_as_strings_stay_apart(make_cache: Factory) -> None:
    cache = make_cache()
    await cache.put("a:b", "c", b"first", ttl_s=60)
    assert await cache.get("a", "b:c") is None
    await cache.put("a}", "k", b"second", ttl_s=60)
    assert await cache.get("a", "k") is None
    assert await cache.get("a}", "k") == b"second"


async def test_expiry(make_cache: Factory) -> None:
    cache = make_cache()
    await cache.put("t1", "short", b"v", ttl_s=0.15)
    await cache.put("t1", "long", b"v", ttl_s=60)
    assert await cache.get("t1", "short") == b"v"
    await asyncio.sleep(0.25)
    assert await cache.get("t1", "short") is None
    assert await cache.get("t1", "long") == b"v"


async def test_zero_ttl_and_oversized_values_are_not_stored(make_cache: Factory) -> None:
    cache = make_cache(max_entry_bytes=8)
    await cache.put("t1", "zero", b"v", ttl_s=0)
    await cache.put("t1", "big", b"123456789", ttl_s=60)
    await cache.put("t1", "fits", b"12345678", ttl_s=60)
    assert await cache.get("t1", "zero") is None
    assert await cache.get("t1", "big") is None
    assert await cache.get("t1", "fits") == b"12345678"


async def test_cap_evicts_the_oldest_of_that_tenant_only(make_cache: Factory) -> None:
    cache = make_cache(max_entries_per_tenant=3)
    await cache.put("other", "keep", b"x", ttl_s=60)
    for i in range(5):
        await cache.put("t1", f"k{i}", str(i).encode(), ttl_s=60)
        await asyncio.sleep(0.002)  # distinct expiry times in Redis
    assert [await cache.get("t1", f"k{i}") for i in range(5)] == [None, None, b"2", b"3", b"4"]
    assert await cache.get("other", "keep") == b"x"


async def test_memory_cap_is_lru() -> None:
    cache = MemoryExactCache(max_entries_per_tenant=2)
    await cache.put("t1", "a", b"a", ttl_s=60)
    await cache.put("t1", "b", b"b", ttl_s=60)
    assert await cache.get("t1", "a") == b"a"  # a is now the most recent
    await cache.put("t1", "c", b"c", ttl_s=60)
    assert await cache.get("t1", "b") is None
    assert await cache.get("t1", "a") == b"a"


async def test_memory_byte_cap_per_tenant() -> None:
    cache = MemoryExactCache(max_bytes_per_tenant=10)
    await cache.put("t1", "a", b"12345", ttl_s=60)
    await cache.put("t1", "b", b"12345", ttl_s=60)
    await cache.put("t1", "c", b"123", ttl_s=60)  # 13 bytes: the oldest goes
    assert await cache.get("t1", "a") is None
    assert await cache.get("t1", "b") == b"12345"
    assert len(cache) == 2


async def test_memory_expiry_uses_its_clock() -> None:
    now = [100.0]
    cache = MemoryExactCache(clock=lambda: now[0])
    await cache.put("t1", "k", b"v", ttl_s=10)
    now[0] = 109.9
    assert await cache.get("t1", "k") == b"v"
    now[0] = 110.0
    assert await cache.get("t1", "k") is None
    assert len(cache) == 0


async def test_redis_keys_are_namespaced_per_tenant(redis: Redis, prefix: str) -> None:
    cache = RedisExactCache(redis, prefix=prefix)
    await cache.put("acme", "k1", b"v", ttl_s=60)
    keys = sorted([key.decode() async for key in redis.scan_iter(match=f"{prefix}:*")])
    assert keys == [f"{prefix}:x:{{acme}}:k1", f"{prefix}:xi:{{acme}}:keys"]
    assert 0 < await redis.pttl(keys[0]) <= 60_000
    assert tenant_prefix(prefix, "x", "a:b") == f"{prefix}:x:{{{tenant_tag('a:b')}}}:"
    assert tenant_tag("a:b").startswith("~") and ":" not in tenant_tag("a:b")


async def test_redis_down_is_a_miss_and_warns_once(dead_redis: Redis,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    cache = RedisExactCache(dead_redis, prefix="sbtest:down", op_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="caching.exact"):
        for _ in range(3):
            await cache.put("t1", "k", b"v", ttl_s=60)
            assert await cache.get("t1", "k") is None
    assert cache.failures.count == 6
    assert len([r for r in caplog.records if r.name == "caching.exact"]) == 1
    await dead_redis.aclose()


async def test_redis_timeout_is_a_miss(redis: Redis, prefix: str) -> None:
    cache = RedisExactCache(redis, prefix=prefix, op_timeout_s=1e-6)
    await cache.put("t1", "k", b"v", ttl_s=60)
    assert await cache.get("t1", "k") is None
    assert cache.failures.count >= 1


async def test_owned_client_is_closed(prefix: str) -> None:
    from redis.asyncio import from_url

    client = from_url("redis://127.0.0.1:6379/0")
    cache = RedisExactCache(client, prefix=prefix, owns_client=True)
    await cache.put("t1", "k", b"v", ttl_s=1)
    await cache.close()
    await cache.close()  # twice is harmless
