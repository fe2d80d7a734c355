"""A worker announces itself in Redis so gateways find it without a config change.

Each worker keeps one key, `switchboard:workers:<id>`, with a TTL a few heartbeats long, and
its id in the set `switchboard:workers`. A worker that dies simply stops refreshing its key
and gateways drop it once the key expires; a clean stop deletes it at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import RedisError

from workers.periodic import Periodic

logger = logging.getLogger(__name__)

WORKERS_SET = "switchboard:workers"
KEY_PREFIX = "switchboard:workers:"


def worker_key(worker_id: str) -> str:
    return KEY_PREFIX + worker_id


class Heartbeat:
    """Refreshes this worker's entry every ttl/3 seconds until stopped."""

    def __init__(self, redis_url: str, *, worker_id: str, ttl_s: float,
                 describe: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self.redis_url = redis_url
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        self._describe = describe
        self._redis: aioredis.Redis | None = None
        # A failed beat keeps the worker serving: gateways with a static config still reach
        # it, and the next beat re-registers it once Redis answers again.
        self._loop = Periodic(self.beat, interval_s=ttl_s / 3, name="worker-heartbeat",
                              survive=(RedisError, OSError))

    async def start(self) -> None:
        self._redis = aioredis.from_url(self.redis_url, socket_timeout=max(self.ttl_s / 3, 0.5))
        await self.beat()  # a worker that cannot register says so at start, not silently
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        if self._redis is not None:
            try:
                await self._redis.delete(worker_key(self.worker_id))
                await self._redis.srem(WORKERS_SET, self.worker_id)
            except RedisError as exc:
                logger.warning("could not deregister worker %s: %s", self.worker_id, exc)
            await self._redis.aclose()
            self._redis = None

    async def beat(self) -> None:
        assert self._redis is not None
        entry = {**await self._describe(), "worker_id": self.worker_id, "ts": time.time()}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(worker_key(self.worker_id), json.dumps(entry), px=int(self.ttl_s * 1000))
            pipe.sadd(WORKERS_SET, self.worker_id)
            await pipe.execute()
