"""The semantic cache in Redis, searched in process: every replica keeps a copy of the index.

Redis holds the truth, per tenant (all keys under one hash tag, see caching/namespace.py):

    <p>:s:{T}:seq        counter: every change gets the next number
    <p>:s:{T}:log        stream of changes: add (id, scope, vector, expiry) and del (id)
    <p>:s:{T}:z          sorted set of live entry ids by expiry time, for the size cap
    <p>:s:{T}:e:<id>     hash: scope, vector, value, question text; expires with the entry

Stores go through one Lua script (write the entry, log it, trim the tenant to its cap and log
those removals). Each replica reads the log incrementally (XRANGE after the last id it saw, in
the same MULTI as the counter) before searching, and a replica that sees a tenant for the first
time, or finds a gap in the numbers (log trimmed past it, keys expired), loads the tenant's live
entries instead. The index can be stale; that is safe because a match is only served after
its value is fetched from the entry's hash, which Redis deletes on expiry and eviction.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from caching.exact import REDIS_FAILURES
from caching.index import DEFAULT_EXACT_MAX_ROWS, VectorIndex, unit
from caching.namespace import tenant_prefix
from caching.semantic_base import CANDIDATES, SemanticHit, passes_guard
from caching.throttle import ThrottledWarning

logger = logging.getLogger(__name__)

# KEYS: seq, log, z. ARGV: entry key prefix, scope, vector, value, text, ttl ms, cap, log
# length. Returns the new entry's id.
_STORE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[6])
local expires = now + ttl
local id = redis.call('INCR', KEYS[1])
local entry = ARGV[1] .. id
redis.call('HSET', entry, 'scope', ARGV[2], 'vec', ARGV[3], 'val', ARGV[4], 'text', ARGV[5])
redis.call('PEXPIRE', entry, ttl)
redis.call('ZADD', KEYS[3], expires, id)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*',
           'seq', id, 'op', 'add', 'id', id, 'scope', ARGV[2], 'vec', ARGV[3], 'exp', expires)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local over = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[7])
if over > 0 then
  local victims = redis.call('ZRANGE', KEYS[3], 0, over - 1)
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, over - 1)
  for _, victim in ipairs(victims) do
    redis.call('DEL', ARGV[1] .. victim)
    local seq = redis.call('INCR', KEYS[1])
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', 'seq', seq, 'op', 'del', 'id', victim)
  end
end
for i = 1, 3 do
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return id
"""

# One step of a first load: ZSCAN a chunk of the tenant's entry ids and return them with their
# expiry, scope and vector packed into a few strings (parsing 100k separate replies would hold
# the event loop for seconds). KEYS: z. ARGV: cursor, count, entry key prefix, vector bytes.
_LOAD_CHUNK = """
local res = redis.call('ZSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local flat = res[2]
local ids, exps, picks, vecs, scopes, scope_of = {}, {}, {}, {}, {}, {}
local size = tonumber(ARGV[4])
for i = 1, #flat, 2 do
  local got = redis.call('HMGET', ARGV[3] .. flat[i], 'scope', 'vec')
  if got[1] and got[2] and #got[2] == size then
    local pick = scope_of[got[1]]
    if not pick then
      scopes[#scopes + 1] = got[1]
      pick = #scopes
      scope_of[got[1]] = pick
    end
    ids[#ids + 1] = flat[i]
    exps[#exps + 1] = flat[i + 1]
    picks[#picks + 1] = pick
    vecs[#vecs + 1] = got[2]
  end
end
return {res[1], table.concat(ids, ','), table.concat(exps, ','), table.concat(picks, ','),
        table.concat(vecs), scopes}
"""


@dataclass
class _Replica:
    """This process's view of one tenant."""

    index: VectorIndex
    loaded: bool = False
    last_id: bytes = b"0-0"  # last log entry applied
    last_seq: int = 0
    expiries: list[tuple[int, str]] = field(default_factory=list)  # heap of (ms, id)
    task: asyncio.Task[None] | None = None  # the sync in flight


class RedisSemanticCache:
    """Vectors and values in Redis; each replica searches its own synced index per tenant.

    `redis` is a `redis.asyncio.Redis` returning bytes. Nothing is sent before the first call.
    A lookup waits at most `op_timeout_s` for the sync (or `first_load_wait_s` for a tenant's
    first load, which carries on in the background) and then searches what it has.
    """

    def __init__(self, redis: Any, *, prefix: str = "sb:cache",
                 max_entries_per_tenant: int = 100_000, max_entry_bytes: int = 1 << 20,
                 dim: int = 384, exact_max_rows: int = DEFAULT_EXACT_MAX_ROWS,
                 log_max_len: int = 10_000, op_timeout_s: float = 0.5,
                 first_load_wait_s: float = 0.2, load_timeout_s: float = 60.0,
                 batch: int = 1000, owns_client: bool = False) -> None:
        self.redis = redis
        self.prefix = prefix
        self.max_entries_per_tenant = max_entries_per_tenant
        self.max_entry_bytes = max_entry_bytes
        self.dim = dim
        self.exact_max_rows = exact_max_rows
        self.log_max_len = log_max_len
        self.op_timeout_s = op_timeout_s
        self.first_load_wait_s = first_load_wait_s
        self.load_timeout_s = load_timeout_s
        self.batch = batch
        self._owns_client = owns_client
        self._store = redis.register_script(_STORE)
        self._load_chunk = redis.register_script(_LOAD_CHUNK)
        self._replicas: dict[str, _Replica] = {}
        self.failures = ThrottledWarning(logger)
        self.loads = 0  # full loads of a tenant, for tests and metrics

    async def lookup(self, tenant_id: str, scope: str, vector: np.ndarray, *,
                     threshold: float, text: str | None = None) -> SemanticHit | None:
        query = unit(vector, self.dim)
        replica = await self._synced(tenant_id)
        if replica is None:
            return None
        matches = replica.index.search(scope, query, threshold=threshold, k=CANDIDATES)
        prefix = self._prefix(tenant_id)
        for match in matches:
            try:
                async with asyncio.timeout(self.op_timeout_s):
                    value, stored_scope, stored_text = await self.redis.hmget(
                        prefix + "e:" + match.entry_id, "val", "scope", "text")
            except REDIS_FAILURES as error:
                self.failures("semantic cache fetch failed, treated as a miss", error)
                return None
            if value is None:  # expired or evicted in Redis since this replica indexed it
                replica.index.remove(match.entry_id)
                continue
            if stored_scope is None or stored_scope.decode() != scope:
                continue
            stored = stored_text.decode() if stored_text else None
            if passes_guard(text, stored):
                return SemanticHit(bytes(value), match.similarity)
        return None

    async def store(self, tenant_id: str, scope: str, vector: np.ndarray, value: bytes, *,
                    ttl_s: float, text: str | None = None) -> None:
        ttl_ms = int(ttl_s * 1000)
        if ttl_ms <= 0 or len(value) > self.max_entry_bytes:
            return
        raw = unit(vector, self.dim).tobytes()
        prefix = self._prefix(tenant_id)
        try:
            async with asyncio.timeout(self.op_timeout_s):
                await self._store(
                    keys=[prefix + "seq", prefix + "log", prefix + "z"],
                    args=[prefix + "e:", scope, raw, value, text or "", ttl_ms,
                          self.max_entries_per_tenant, self.log_max_len])
        except REDIS_FAILURES as error:
            self.failures("semantic cache store failed, not stored", error)

    async def sync(self, tenant_id: str) -> None:
        """Bring this replica's index for the tenant up to date now (warm-up, tests)."""
        replica = self._replica(tenant_id)
        await self._start_sync(replica, tenant_id)

    async def close(self) -> None:
        tasks = [r.task for r in self._replicas.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._replicas.clear()
        if self._owns_client:
            await self.redis.aclose()

    def indexed(self, tenant_id: str) -> int:
        """Entries in this replica's index for the tenant (stale ones included)."""
        replica = self._replicas.get(tenant_id)
        return 0 if replica is None else len(replica.index)

    async def _synced(self, tenant_id: str) -> _Replica | None:
        """The tenant's replica after a sync, or as it is if the sync takes too long."""
        replica = self._replica(tenant_id)
        wait = self.op_timeout_s if replica.loaded else self.first_load_wait_s
        try:
            async with asyncio.timeout(wait):
                await asyncio.shield(self._start_sync(replica, tenant_id))
        except TimeoutError:
            pass  # it goes on in the background; search what is there
        except Exception as error:  # a cache never fails a request: log (throttled), miss
            self.failures("semantic cache sync failed, treated as a miss", error)
            return None
        return replica if replica.loaded else None

    def _start_sync(self, replica: _Replica, tenant_id: str) -> asyncio.Task[None]:
        """Join the sync in flight or start one: concurrent lookups share one round trip."""
        task = replica.task
        if task is not None and task.done():
            if not task.cancelled() and task.exception() is not None:
                self.failures("semantic cache sync failed", task.exception())  # type: ignore[arg-type]
            task = None
        if task is None:
            task = asyncio.ensure_future(self._sync(replica, tenant_id))
            replica.task = task
        return task

    async def _sync(self, replica: _Replica, tenant_id: str) -> None:
        async with asyncio.timeout(self.load_timeout_s):
            if not replica.loaded or not await self._follow(replica, tenant_id):
                await self._load(replica, tenant_id)
        self._expire(replica)

    async def _follow(self, replica: _Replica, tenant_id: str) -> bool:
        """Apply new log entries; False when the log cannot continue this replica's view."""
        prefix = self._prefix(tenant_id)
        for _ in range(10):  # bounded: a replica far behind catches up over several lookups
            pipe = self.redis.pipeline(transaction=True)
            pipe.xrange(prefix + "log", min=b"(" + replica.last_id, max="+", count=self.batch)
            pipe.get(prefix + "seq")
            events, seq = await pipe.execute()
            seq = int(seq) if seq is not None else 0
            if seq < replica.last_seq:
                return False  # the tenant's keys expired and started over
            if not events:
                return seq == replica.last_seq  # else: the log was trimmed past us
            if int(events[0][1][b"seq"]) != replica.last_seq + 1:
                return False  # a gap: trimmed entries we never saw
            for event_id, fields in events:
                self._apply(replica, fields)
                replica.last_id, replica.last_seq = event_id, int(fields[b"seq"])
            if len(events) < self.batch:
                return True
        return True

    async def _load(self, replica: _Replica, tenant_id: str) -> None:
        """Replace the replica's view with the tenant's live entries.

        The log position is read first; the entries are then scanned in chunks (ZSCAN returns
        every entry present throughout). Changes during the scan are in the log after that
        position and are applied on the next sync; adding or removing twice is harmless.
        """
        prefix = self._prefix(tenant_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.get(prefix + "seq")
        pipe.xrevrange(prefix + "log", max="+", min="-", count=1)
        seq, last = await pipe.execute()
        fresh = _Replica(VectorIndex(self.dim, exact_max_rows=self.exact_max_rows))
        cursor: bytes | int = 0
        for _ in range(1_000_000):  # ZSCAN ends; the bound only makes that visible
            cursor, ids, expiries, picks, blob, scopes = await self._load_chunk(
                keys=[prefix + "z"], args=[cursor, self.batch, prefix + "e:", 4 * self.dim])
            if ids:
                self._add_chunk(fresh, ids.decode().split(","), expiries.decode().split(","),
                                picks.decode().split(","), blob, [s.decode() for s in scopes])
            if int(cursor) == 0:
                break
        heapq.heapify(fresh.expiries)
        replica.index, replica.expiries = fresh.index, fresh.expiries
        replica.last_id = last[0][0] if last else b"0-0"
        replica.last_seq = int(seq) if seq is not None else 0
        replica.loaded = True
        self.loads += 1

    def _add_chunk(self, replica: _Replica, ids: list[str], expiries: list[str],
                   picks: list[str], blob: bytes, scopes: list[str]) -> None:
        vectors = np.frombuffer(blob, dtype=np.float32).reshape(len(ids), self.dim)
        rows_by_scope: dict[int, list[int]] = defaultdict(list)
        for row, pick in enumerate(picks):
            rows_by_scope[int(pick) - 1].append(row)
        for scope, rows in rows_by_scope.items():
            replica.index.add_many(scopes[scope], [ids[r] for r in rows], vectors[rows])
        replica.expiries.extend((int(float(t)), i) for t, i in zip(expiries, ids, strict=True))

    def _apply(self, replica: _Replica, fields: dict[bytes, bytes]) -> None:
        entry_id = fields[b"id"].decode()
        if fields[b"op"] == b"del":
            replica.index.remove(entry_id)
            return
        vector = self._vector(fields.get(b"vec"))
        if vector is None:
            return
        replica.index.add(fields[b"scope"].decode(), entry_id, vector)
        heapq.heappush(replica.expiries, (int(fields[b"exp"]), entry_id))

    def _expire(self, replica: _Replica) -> None:
        """Drop entries past their expiry from the local index (Redis has dropped them)."""
        now_ms = int(time.time() * 1000)
        while replica.expiries and replica.expiries[0][0] <= now_ms:
            replica.index.remove(heapq.heappop(replica.expiries)[1])

    def _vector(self, raw: bytes | None) -> np.ndarray | None:
        if raw is None or len(raw) != 4 * self.dim:
            return None
        return np.frombuffer(raw, dtype=np.float32)

    def _replica(self, tenant_id: str) -> _Replica:
        replica = self._replicas.get(tenant_id)
        if replica is None:
            replica = _Replica(VectorIndex(self.dim, exact_max_rows=self.exact_max_rows))
            self._replicas[tenant_id] = replica
        return replica

    def _prefix(self, tenant_id: str) -> str:
        return tenant_prefix(self.prefix, "s", tenant_id)
