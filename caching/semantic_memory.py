"""The in-process semantic cache: one vector index per tenant, with expiry and a size cap."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from caching.index import DEFAULT_EXACT_MAX_ROWS, VectorIndex
from caching.semantic_base import CANDIDATES, SemanticHit, passes_guard


@dataclass(slots=True)
class _Entry:
    value: bytes
    text: str | None
    expires: float


@dataclass
class _Tenant:
    index: VectorIndex
    entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)  # LRU order
    expiries: list[tuple[float, str]] = field(default_factory=list)  # heap
    bytes: int = 0


class MemorySemanticCache:
    """Per-tenant vector index; least recently used entries go first when a tenant is full."""

    def __init__(self, *, max_entries_per_tenant: int = 100_000,
                 max_entry_bytes: int = 1 << 20, max_bytes_per_tenant: int = 256 << 20,
                 dim: int = 384, exact_max_rows: int = DEFAULT_EXACT_MAX_ROWS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries_per_tenant = max_entries_per_tenant
        self.max_entry_bytes = max_entry_bytes
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self.dim = dim
        self.exact_max_rows = exact_max_rows
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._ids = itertools.count(1)

    async def lookup(self, tenant_id: str, scope: str, vector: np.ndarray, *,
                     threshold: float, text: str | None = None) -> SemanticHit | None:
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            return None
        self._expire(tenant)
        for match in tenant.index.search(scope, vector, threshold=threshold, k=CANDIDATES):
            entry = tenant.entries[match.entry_id]
            if passes_guard(text, entry.text):
                tenant.entries.move_to_end(match.entry_id)
                return SemanticHit(entry.value, match.similarity)
        return None

    async def store(self, tenant_id: str, scope: str, vector: np.ndarray, value: bytes, *,
                    ttl_s: float, text: str | None = None) -> None:
        if ttl_s <= 0 or len(value) > min(self.max_entry_bytes, self.max_bytes_per_tenant):
            return
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            tenant = _Tenant(VectorIndex(self.dim, exact_max_rows=self.exact_max_rows))
            self._tenants[tenant_id] = tenant
        entry_id = str(next(self._ids))
        tenant.index.add(scope, entry_id, vector)  # validates the vector before anything else
        expires = self._clock() + ttl_s
        tenant.entries[entry_id] = _Entry(bytes(value), text, expires)
        tenant.bytes += len(value)
        heapq.heappush(tenant.expiries, (expires, entry_id))
        self._expire(tenant)
        while (len(tenant.entries) > self.max_entries_per_tenant
               or tenant.bytes > self.max_bytes_per_tenant):
            self._remove(tenant, next(iter(tenant.entries)))

    async def close(self) -> None:
        self._tenants.clear()

    def size(self, tenant_id: str) -> int:
        tenant = self._tenants.get(tenant_id)
        return 0 if tenant is None else len(tenant.entries)

    def _expire(self, tenant: _Tenant) -> None:
        now = self._clock()
        while tenant.expiries and tenant.expiries[0][0] <= now:
            _, entry_id = heapq.heappop(tenant.expiries)
            self._remove(tenant, entry_id)
        if len(tenant.expiries) > 2 * len(tenant.entries) + 64:  # drop evicted ids' leftovers
            tenant.expiries = [(t, i) for t, i in tenant.expiries if i in tenant.entries]
            heapq.heapify(tenant.expiries)

    @staticmethod
    def _remove(tenant: _Tenant, entry_id: str) -> None:
        entry = tenant.entries.pop(entry_id, None)
        if entry is not None:
            tenant.bytes -= len(entry.value)
            tenant.index.remove(entry_id)
