"""Limiter fixtures: each test gets both backends, its own Redis namespace, and cleanup."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis

from tenancy.limits import InProcessLimiter, Limiter, RedisLimiter

REDIS_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def namespace() -> Iterator[str]:
    """A random key prefix; its keys (and only those) are deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"sb:rl:{name}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def make(backend: str, namespace: str) -> AsyncIterator[Callable[..., Limiter]]:
    """Build limiters of the parametrized backend; Redis ones share the test's namespace."""
    built: list[Limiter] = []

    def build(**options: Any) -> Limiter:
        limiter: Limiter
        if backend == "memory":
            options.pop("timeout_s", None)
            limiter = InProcessLimiter(**options)
        else:
            options.pop("clock", None)
            options.setdefault("timeout_s", 2.0)  # generous: CI machines are small and busy
            limiter = RedisLimiter(REDIS_URL, fail_open=False, namespace=namespace, **options)
        built.append(limiter)
        return limiter

    yield build
    for limiter in built:
        await limiter.close()


@pytest.fixture
async def limiter(make: Callable[..., Limiter]) -> Limiter:
    return make()
