"""Worker heartbeats in a real Redis: an entry appears, refreshes, expires, and is removed."""

from __future__ import annotations

import asyncio
import json
import uuid

from redis import asyncio as aioredis

from workers.server.registration import WORKERS_SET, Heartbeat, worker_key

REDIS = "redis://127.0.0.1:6379/0"


async def test_heartbeat_registers_refreshes_and_deregisters():
    worker_id = f"test-{uuid.uuid4().hex}"
    beats = 0

    async def describe():
        nonlocal beats
        beats += 1
        return {"url": "http://127.0.0.1:9", "model": "m", "beat": beats}

    redis = aioredis.from_url(REDIS)
    heartbeat = Heartbeat(REDIS, worker_id=worker_id, ttl_s=0.6, describe=describe)
    try:
        await heartbeat.start()
        entry = json.loads(await redis.get(worker_key(worker_id)))
        assert entry["worker_id"] == worker_id and entry["url"] == "http://127.0.0.1:9"
        assert await redis.sismember(WORKERS_SET, worker_id)
        assert 0 < await redis.pttl(worker_key(worker_id)) <= 600
        await asyncio.sleep(1.0)  # several beats: the key outlives its TTL and is refreshed
        entry = json.loads(await redis.get(worker_key(worker_id)))
        assert entry["beat"] >= 3
        await heartbeat.stop()
        assert await redis.get(worker_key(worker_id)) is None
        assert not await redis.sismember(WORKERS_SET, worker_id)
    finally:
        await heartbeat.stop()
        await redis.srem(WORKERS_SET, worker_id)
        await redis.aclose()


async def test_a_worker_that_stops_beating_expires():
    worker_id = f"test-{uuid.uuid4().hex}"

    async def describe():
        return {"url": "http://127.0.0.1:9", "model": "m"}

    redis = aioredis.from_url(REDIS)
    heartbeat = Heartbeat(REDIS, worker_id=worker_id, ttl_s=0.5, describe=describe)
    try:
        await heartbeat.start()
        await heartbeat._loop.stop()  # the process froze: no more beats, no clean stop
        await asyncio.sleep(0.8)
        assert await redis.get(worker_key(worker_id)) is None
    finally:
        await heartbeat.stop()
        await redis.srem(WORKERS_SET, worker_id)
        await redis.aclose()
