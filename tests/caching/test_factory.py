"""make_caches: in-process without a URL, Redis with one, and no I/O until first use."""

from __future__ import annotations

import numpy as np
from redis.asyncio import Redis

from caching.exact import MemoryExactCache, RedisExactCache
from caching.factory import make_caches
from caching.semantic import MemorySemanticCache, RedisSemanticCache
from tests.caching.conftest import REDIS_URL


async def test_no_url_gives_in_process_caches() -> None:
    exact, semantic = make_caches(redis_url="", max_entries_per_tenant=5,
                                  semantic_max_entries_per_tenant=7, max_entry_bytes=9)
    assert isinstance(exact, MemoryExactCache) and isinstance(semantic, MemorySemanticCache)
    assert (exact.max_entries_per_tenant, exact.max_entry_bytes) == (5, 9)
    assert semantic.max_entries_per_tenant == 7


async def test_unreachable_url_builds_without_io_and_misses() -> None:
    exact, semantic = make_caches(redis_url="redis://127.0.0.1:1/0", connect_timeout_s=0.2)
    assert isinstance(exact, RedisExactCache) and isinstance(semantic, RedisSemanticCache)
    assert await exact.get("t", "k") is None
    vector = np.ones(384, dtype=np.float32)
    assert await semantic.lookup("t", "s", vector, threshold=0.5) is None
    await exact.close()
    await semantic.close()


async def test_redis_caches_share_one_client_and_work(redis: Redis, prefix: str) -> None:
    exact, semantic = make_caches(redis_url=REDIS_URL, prefix=prefix)
    assert exact.redis is semantic.redis  # type: ignore[attr-defined]
    await exact.put("t", "k", b"v", ttl_s=60)
    assert await exact.get("t", "k") == b"v"
    vector = np.ones(384, dtype=np.float32)
    await semantic.store("t", "s", vector, b"answer", ttl_s=60)
    hit = await semantic.lookup("t", "s", vector, threshold=0.9)
    assert hit is not None and hit.value == b"answer"
    await exact.close()
    await semantic.close()  # closing the shared client twice is harmless
