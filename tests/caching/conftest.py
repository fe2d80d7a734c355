"""Caching fixtures: a real Redis namespace per test (cleaned up after), one embedder per run."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis, from_url

from caching.embedder import Embedder

REDIS_URL = os.environ.get("SWITCHBOARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
async def redis() -> AsyncIterator[Redis]:
    client = from_url(REDIS_URL, socket_timeout=2.0, socket_connect_timeout=2.0)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis: Redis) -> AsyncIterator[str]:
    """A namespace no other test (or process) uses; every key under it is deleted afterwards."""
    name = f"sbtest:{uuid.uuid4().hex[:12]}"
    yield name
    keys = [key async for key in redis.scan_iter(match=f"{name}:*", count=1000)]
    if keys:
        await redis.delete(*keys)


@pytest.fixture
def dead_redis() -> Redis:
    """A client for a loopback port nothing listens on: every call fails fast."""
    return from_url("redis://127.0.0.1:1/0", socket_timeout=0.2, socket_connect_timeout=0.2)


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    model = Embedder()
    model.load()
    return model
