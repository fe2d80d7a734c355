"""A per-replica cache of database lookups, for the hot path: keys and tenant adapters.

Found values and (a bounded number of) misses are kept until `clear()`, which the auth
watcher calls when the auth version moves. Concurrent misses of one key share one load, and
a load that was running when the cache was cleared is not stored: an invalidation never
loses a race against a slow query.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LookupCache(Generic[K, V]):
    def __init__(self, negative_size: int) -> None:
        self.found: dict[K, V] = {}
        self.missing: collections.OrderedDict[K, None] = collections.OrderedDict()
        self._loading: dict[K, asyncio.Future[V | None]] = {}
        self._negative_size = negative_size
        self._generation = 0

    def clear(self) -> None:
        self.found.clear()
        self.missing.clear()
        self._generation += 1

    async def get(self, key: K, load: Callable[[], Awaitable[V | None]]) -> V | None:
        """The cached value, or `load()`'s (None: missing, remembered as such)."""
        if key in self.found:
            return self.found[key]
        if key in self.missing:
            return None
        pending = self._loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[V | None] = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        generation = self._generation
        try:
            value = await load()
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody logs it twice
            raise
        finally:
            self._loading.pop(key, None)
        if generation == self._generation:  # no invalidation raced with this load
            if value is None:
                self._remember_missing(key)
            else:
                self.found[key] = value
        future.set_result(value)
        return value

    def _remember_missing(self, key: K) -> None:
        self.missing[key] = None
        if len(self.missing) > self._negative_size:
            self.missing.popitem(last=False)
