"""Workers found in Redis become deployments, and leave when their heartbeat stops.

A `provider: worker` entry with `discover: true` is a template: each worker registered under
`switchboard:workers` (see workers/server/registration.py) whose model is the template's
upstream model becomes `<template>@<worker id>` with the template's prices, tier and window.
A worker whose key expired (it died) or was deleted (it stopped) is removed; requests already
running on it finish or fail over as with any deployment.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import RedisError

from gateway.deployments.base import Deployment
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.registry import DeploymentRegistry
from workers.periodic import Periodic
from workers.server.registration import WORKERS_SET, worker_key

logger = logging.getLogger(__name__)


def discovered_config(template: DeploymentConfig, entry: dict[str, Any]) -> DeploymentConfig:
    return template.model_copy(update={
        "name": f"{template.name}@{entry['worker_id']}", "discover": False,
        "base_url": str(entry["url"]).rstrip("/") + "/v1",
    })


class WorkerDiscovery:
    def __init__(self, templates: Sequence[DeploymentConfig], registry: DeploymentRegistry, *,
                 redis_url: str, interval_s: float,
                 build: Callable[[DeploymentConfig], Awaitable[Deployment]]) -> None:
        self.templates = list(templates)
        self.registry = registry
        self.redis_url = redis_url
        self._build = build  # builds, starts and prices a deployment
        self._redis: aioredis.Redis | None = None
        self._loop = Periodic(self.sync, interval_s=interval_s, name="worker-discovery")
        self.found: dict[str, str] = {}  # deployment name -> the worker URL it was built for

    async def start(self) -> None:
        self._redis = aioredis.from_url(self.redis_url, socket_timeout=2.0)
        await self.sync()
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def sync(self) -> None:
        """Add newly registered workers and remove vanished ones."""
        try:
            entries = await self._entries()
        except (RedisError, OSError) as exc:
            logger.warning("worker discovery cannot read Redis: %s", exc)
            return  # keep what we have; the stats poll still tells dead workers apart
        wanted: dict[str, DeploymentConfig] = {}
        for entry in entries:
            for template in self.templates:
                if entry.get("model") == (template.upstream_model or template.model_name):
                    config = discovered_config(template, entry)
                    wanted[config.name] = config
        for name in [n for n in self.found if n not in wanted
                     or wanted[n].base_url != self.found[n]]:
            deployment = self.registry.remove(name)
            self.found.pop(name)
            if deployment is not None:
                logger.info("worker deployment %s left", name)
                await deployment.close()
        for name, config in wanted.items():
            if name in self.found or self.registry.get(name) is not None:
                continue
            deployment = await self._build(config)
            self.registry.add(deployment)
            self.found[name] = config.base_url or ""
            logger.info("worker deployment %s joined at %s", name, config.base_url)

    async def _entries(self) -> list[dict[str, Any]]:
        assert self._redis is not None
        ids = sorted(m.decode() for m in await self._redis.smembers(WORKERS_SET))
        if not ids:
            return []
        raws = await self._redis.mget([worker_key(i) for i in ids])
        entries = []
        gone = []
        for worker_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                gone.append(worker_id)  # expired: the worker died without deregistering
                continue
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("url") and entry.get("worker_id"):
                entries.append(entry)
        if gone:
            await self._redis.srem(WORKERS_SET, *gone)
        return entries
