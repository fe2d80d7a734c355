"""Helpers for the semantic-cache tests: exact test vectors, and caches closed after a test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import numpy as np

from caching.semantic import SemanticCache

DIM = 16  # small, so a test can spell out its vectors

Cache = TypeVar("Cache", bound=SemanticCache)


def e(i: int) -> np.ndarray:
    """The i-th basis vector of DIM: unit length and orthogonal to every other e(j), so the
    cosines a test builds from them are exact."""
    v = np.zeros(DIM, dtype=np.float32)
    v[i] = 1.0
    return v


@asynccontextmanager
async def cache_factory(make: Callable[..., Cache]) -> AsyncIterator[Callable[..., Cache]]:
    """`make` as a fixture's factory: a test may build several caches (replicas, other caps),
    and every one is closed when the test is done, so no sync task outlives it."""
    made: list[Cache] = []

    def factory(**kwargs: Any) -> Cache:
        cache = make(**kwargs)
        made.append(cache)
        return cache

    try:
        yield factory
    finally:
        for cache in made:
            await cache.close()
