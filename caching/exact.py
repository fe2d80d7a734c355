"""Exact response caches: a whole answer by its canonical key, kept per tenant.

Two backends with one protocol: in-process (the embedded default) and Redis (shared by the
gateway replicas). Both partition by tenant before anything else, cap each tenant's share, and
treat their own failures as misses: a cache must never fail a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from redis.exceptions import RedisError

from caching.namespace import tenant_prefix
from caching.throttle import ThrottledWarning

logger = logging.getLogger(__name__)
REDIS_FAILURES = (RedisError, OSError, TimeoutError)


class ExactCache(Protocol):
    async def get(self, tenant_id: str, key: str) -> bytes | None: ...

    async def put(self, tenant_id: str, key: str, value: bytes, *, ttl_s: float) -> None: ...

    async def close(self) -> None: ...


class MemoryExactCache:
    """Per-tenant LRU with expiry; caps on entries and bytes per tenant and on entry size."""

    def __init__(self, *, max_entries_per_tenant: int = 10_000, max_entry_bytes: int = 1 << 20,
                 max_bytes_per_tenant: int = 64 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries_per_tenant = max_entries_per_tenant
        self.max_entry_bytes = max_entry_bytes
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._clock = clock
        self._tenants: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._bytes: dict[str, int] = {}

    async def get(self, tenant_id: str, key: str) -> bytes | None:
        entries = self._tenants.get(tenant_id)
        item = None if entries is None else entries.get(key)
        if item is None:
            return None
        expires, value = item
        if expires <= self._clock():
            self._drop(tenant_id, key)
            return None
        entries.move_to_end(key)
        return value

    async def put(self, tenant_id: str, key: str, value: bytes, *, ttl_s: float) -> None:
        if ttl_s <= 0 or len(value) > min(self.max_entry_bytes, self.max_bytes_per_tenant):
            return
        self._drop(tenant_id, key)
        entries = self._tenants.setdefault(tenant_id, OrderedDict())
        entries[key] = (self._clock() + ttl_s, bytes(value))
        self._bytes[tenant_id] = self._bytes.get(tenant_id, 0) + len(value)
        while (len(entries) > self.max_entries_per_tenant
               or self._bytes[tenant_id] > self.max_bytes_per_tenant):
            self._drop(tenant_id, next(iter(entries)))

    async def close(self) -> None:
        self._tenants.clear()
        self._bytes.clear()

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._tenants.values())

    def _drop(self, tenant_id: str, key: str) -> None:
        entries = self._tenants.get(tenant_id)
        item = None if entries is None else entries.pop(key, None)
        if item is None:
            return
        self._bytes[tenant_id] -= len(item[1])
        if not entries:
            del self._tenants[tenant_id]
            del self._bytes[tenant_id]


# Store one entry and trim the tenant to its cap, atomically. The index is a sorted set of the
# tenant's keys scored by expiry time: expired members are dropped, then the soonest to expire
# (the oldest, when all share one TTL) until the tenant is within its cap.
# KEYS: entry, index. ARGV: value, ttl ms, cap, entry key prefix, member (the cache key).
_PUT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if over > 0 then
  for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, over - 1)) do
    redis.call('DEL', ARGV[4] .. member)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, over - 1)
end
if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
return over
"""


class RedisExactCache:
    """Entries as Redis strings with PX expiry, under a per-tenant key prefix.

    `redis` is a `redis.asyncio.Redis` returning bytes (not decode_responses). Nothing is sent
    before the first get/put. Every call is bounded by `op_timeout_s`; failures are misses.
    """

    def __init__(self, redis: Any, *, prefix: str = "sb:cache",
                 max_entries_per_tenant: int = 10_000, max_entry_bytes: int = 1 << 20,
                 op_timeout_s: float = 0.5, owns_client: bool = False) -> None:
        self.redis = redis
        self.prefix = prefix
        self.max_entries_per_tenant = max_entries_per_tenant
        self.max_entry_bytes = max_entry_bytes
        self.op_timeout_s = op_timeout_s
        self._owns_client = owns_client
        self._put = redis.register_script(_PUT)
        self.failures = ThrottledWarning(logger)

    async def get(self, tenant_id: str, key: str) -> bytes | None:
        try:
            async with asyncio.timeout(self.op_timeout_s):
                value = await self.redis.get(self._entry(tenant_id, key))
        except REDIS_FAILURES as error:
            self.failures("exact cache get failed, treated as a miss", error)
            return None
        return None if value is None else bytes(value)

    async def put(self, tenant_id: str, key: str, value: bytes, *, ttl_s: float) -> None:
        ttl_ms = int(ttl_s * 1000)
        if ttl_ms <= 0 or len(value) > self.max_entry_bytes:
            return
        try:
            async with asyncio.timeout(self.op_timeout_s):
                await self._put(
                    keys=[self._entry(tenant_id, key), self._index(tenant_id)],
                    args=[value, ttl_ms, self.max_entries_per_tenant,
                          tenant_prefix(self.prefix, "x", tenant_id), key])
        except REDIS_FAILURES as error:
            self.failures("exact cache put failed, not stored", error)

    async def close(self) -> None:
        if self._owns_client:
            await self.redis.aclose()

    def _entry(self, tenant_id: str, key: str) -> str:
        return tenant_prefix(self.prefix, "x", tenant_id) + key

    def _index(self, tenant_id: str) -> str:
        return tenant_prefix(self.prefix, "xi", tenant_id) + "keys"
