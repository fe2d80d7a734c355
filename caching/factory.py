"""Build the exact and semantic caches from settings: in-process, or Redis when a URL is set."""

from __future__ import annotations

from caching.exact import ExactCache, MemoryExactCache, RedisExactCache
from caching.semantic import MemorySemanticCache, RedisSemanticCache, SemanticCache


def make_caches(*, redis_url: str, prefix: str = "sb:cache",
                max_entries_per_tenant: int = 10_000,
                semantic_max_entries_per_tenant: int = 100_000,
                max_entry_bytes: int = 1 << 20, op_timeout_s: float = 0.5,
                connect_timeout_s: float = 0.5) -> tuple[ExactCache, SemanticCache]:
    """("" -> in-process caches). The Redis client is created here but connects on first use;
    both caches share it and both may close it (closing twice is harmless)."""
    if not redis_url:
        return (MemoryExactCache(max_entries_per_tenant=max_entries_per_tenant,
                                 max_entry_bytes=max_entry_bytes),
                MemorySemanticCache(max_entries_per_tenant=semantic_max_entries_per_tenant,
                                    max_entry_bytes=max_entry_bytes))
    from redis.asyncio import from_url

    client = from_url(redis_url, socket_timeout=op_timeout_s,
                      socket_connect_timeout=connect_timeout_s, decode_responses=False)
    return (RedisExactCache(client, prefix=prefix, max_entries_per_tenant=max_entries_per_tenant,
                            max_entry_bytes=max_entry_bytes, op_timeout_s=op_timeout_s,
                            owns_client=True),
            RedisSemanticCache(client, prefix=prefix,
                               max_entries_per_tenant=semantic_max_entries_per_tenant,
                               max_entry_bytes=max_entry_bytes, op_timeout_s=op_timeout_s,
                               owns_client=True))
