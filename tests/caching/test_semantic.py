"""Semantic caches on both backends: hits, thresholds, scopes, tenants, expiry, caps, guard."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import partial

import numpy as np
import pytest
from redis.asyncio import Redis

from caching.semantic import MemorySemanticCache, RedisSemanticCache, SemanticCache, SemanticHit
from tests.caching.support import DIM, cache_factory, e

Factory = Callable[..., SemanticCache]


def near(i: int, j: int, cos: float) -> np.ndarray:
    return (cos * e(i) + np.sqrt(1 - cos * cos) * e(j)).astype(np.float32)


@pytest.fixture(params=["memory", "redis"])
async def make_cache(request: pytest.FixtureRequest, redis: Redis,
                     prefix: str) -> AsyncIterator[Factory]:
    make: Factory
    if request.param == "memory":
        make = partial(MemorySemanticCache, dim=DIM)
    else:
        make = partial(RedisSemanticCache, redis, prefix=prefix, dim=DIM)
    async with cache_factory(make) as factory:
        yield factory


async def test_hit_above_threshold_miss_below(make_cache: Factory) -> None:
    cache = make_cache()
    assert await cache.lookup("t1", "s", e(0), threshold=0.8) is None
    await cache.store("t1", "s", e(0), b"paris", ttl_s=60)
    hit = await cache.lookup("t1", "s", near(0, 1, 0.9), threshold=0.8)
    assert isinstance(hit, SemanticHit) and hit.value == b"paris"
    assert hit.similarity == pytest.approx(0.9, abs=1e-5)
    assert await cache.lookup("t1", "s", near(0, 1, 0.7), threshold=0.8) is None


async def test_best_match_is_served(make_cache: Factory) -> None:
    cache = make_cache()
    await cache.store("t1", "s", near(0, 1, 0.85), b"close", ttl_s=60)
    await cache.store("t1", "s", near(0, 2, 0.95), b"closer", ttl_s=60)
    await cache.store("t1", "s", e(3), b"far", ttl_s=60)
    hit = await cache.lookup("t1", "s", e(0), threshold=0.8)
    assert hit is not None and hit.value == b"closer"


async def test_same_vector_and_scope_under_two_tenants_never_crosses(make_cache: Factory) -> None:
    cache = make_cache()
    await cache.store("alpha", "s", e(0), b"alpha's answer", ttl_s=60)
    assert await cache.lookup("beta", "s", e(0), threshold=0.5) is None
    await cache.store("beta", "s", e(0), b"beta's answer", ttl_s=60)
    alpha = await cache.lookup("alpha", "s", e(0), threshold=0.5)
    beta = await cache.lookup("beta", "s", e(0), threshold=0.5)
    assert alpha is not None and alpha.value == b"alpha's answer"
    assert beta is not None and beta.value == b"beta's answer"


async def test_scopes_never_cross(make_cache: Factory) -> None:
    cache = make_cache()
    await cache.store("t1", "system-prompt-a", e(0), b"a", ttl_s=60)
    assert await cache.lookup("t1", "system-prompt-b", e(0), threshold=0.5) is None


async def test_expiry(make_cache: Factory) -> None:
    cache = make_cache()
    await cache.store("t1", "s", e(0), b"short", ttl_s=0.15)
    await cache.store("t1", "s", near(0, 1, 0.9), b"long", ttl_s=60)
    hit = await cache.lookup("t1", "s", e(0), threshold=0.8)
    assert hit is not None and hit.value == b"short"
    await asyncio.sleep(0.25)
    hit = await cache.lookup("t1", "s", e(0), threshold=0.8)
    assert hit is not None and hit.value == b"long"


async def test_cap_evicts_oldest_and_only_in_that_tenant(make_cache: Factory) -> None:
    cache = make_cache(max_entries_per_tenant=3)
    await cache.store("other", "s", e(0), b"kept", ttl_s=60)
    for i in range(5):
        await cache.store("t1", "s", e(i), f"v{i}".encode(), ttl_s=60)
        await asyncio.sleep(0.002)  # distinct expiry times in Redis
    found = [await cache.lookup("t1", "s", e(i), threshold=0.99) for i in range(5)]
    assert [None if h is None else h.value for h in found] == [None, None, b"v2", b"v3", b"v4"]
    kept = await cache.lookup("other", "s", e(0), threshold=0.99)
    assert kept is not None and kept.value == b"kept"


async def test_zero_ttl_and_oversized_values_are_not_stored(make_cache: Factory) -> None:
    cache = make_cache(max_entry_bytes=4)
    await cache.store("t1", "s", e(0), b"v", ttl_s=0)
    await cache.store("t1", "s", e(1), b"12345", ttl_s=60)
    assert await cache.lookup("t1", "s", e(0), threshold=0.5) is None
    assert await cache.lookup("t1", "s", e(1), threshold=0.5) is None


async def test_guard_refuses_a_changed_slot_and_falls_back_to_the_next_match(
        make_cache: Factory) -> None:
    cache = make_cache()
    await cache.store("t1", "s", e(0), b"berlin", ttl_s=60,
                      text="What is the capital of Germany?")
    await cache.store("t1", "s", near(0, 1, 0.9), b"paris", ttl_s=60,
                      text="What's the capital city of France?")
    query = "What is the capital of France?"
    hit = await cache.lookup("t1", "s", e(0), threshold=0.8, text=query)
    assert hit is not None and hit.value == b"paris"  # the nearer one failed the guard
    unguarded = await cache.lookup("t1", "s", e(0), threshold=0.8)
    assert unguarded is not None and unguarded.value == b"berlin"


async def test_entries_without_text_never_match_a_guarded_lookup(make_cache: Factory) -> None:
    cache = make_cache()
    await cache.store("t1", "s", e(0), b"v", ttl_s=60)
    assert await cache.lookup("t1", "s", e(0), threshold=0.5, text="anything?") is None


async def test_wrong_vector_shape_is_an_error(make_cache: Factory) -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        await cache.store("t1", "s", np.ones(DIM + 1), b"v", ttl_s=60)
    with pytest.raises(ValueError):
        await cache.lookup("t1", "s", np.zeros(DIM), threshold=0.5)


async def test_memory_cap_is_lru() -> None:
    cache = MemorySemanticCache(dim=DIM, max_entries_per_tenant=2)
    await cache.store("t1", "s", e(0), b"a", ttl_s=60)
    await cache.store("t1", "s", e(1), b"b", ttl_s=60)
    assert await cache.lookup("t1", "s", e(0), threshold=0.99) is not None
    await cache.store("t1", "s", e(2), b"c", ttl_s=60)
    assert await cache.lookup("t1", "s", e(1), threshold=0.99) is None
    assert await cache.lookup("t1", "s", e(0), threshold=0.99) is not None
    assert cache.size("t1") == 2


async def test_memory_expiry_uses_its_clock_and_frees_the_index() -> None:
    now = [0.0]
    cache = MemorySemanticCache(dim=DIM, clock=lambda: now[0])
    for i in range(10):
        await cache.store("t1", "s", e(i), b"v", ttl_s=5 + i)
    now[0] = 9.5  # entries 0..4 have expired
    assert await cache.lookup("t1", "s", e(4), threshold=0.99) is None
    assert await cache.lookup("t1", "s", e(5), threshold=0.99) is not None
    assert cache.size("t1") == 5
