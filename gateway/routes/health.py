"""Health for load balancers, orchestrators and scripts (no auth, no secrets).

- `GET /health/live`: the process is up and serving HTTP (a liveness probe: restart if not).
- `GET /health/ready`: the database answers, and Redis answers when one is configured (a
  readiness probe: send no traffic while not). 503 with the failing checks otherwise.
- `GET /health`: deployments and their breaker and load figures, for people and scripts.

The answers name what failed by its exception type only, never a URL or a password.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from gateway.deps import StateDep
from gateway.state import GatewayState

logger = logging.getLogger(__name__)
router = APIRouter(tags=["health"])

# Each dependency gets this long to answer `SELECT 1` / `PING`; a probe's own timeout (k8s
# defaults to 1 s; deploy/ sets 3 s) must exceed the two together.
CHECK_TIMEOUT_S = 1.0


@router.get("/health")
async def health(state: StateDep) -> JSONResponse:
    return JSONResponse({"status": "ok", "deployments": {
        d.name: {"model": d.config.model_name, **d.stats()}
        for d in state.deployments.deployments()
    }})


@router.get("/health/live")
async def live() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/health/ready")
async def ready(state: StateDep) -> JSONResponse:
    database, redis = await asyncio.gather(_timed(_database(state)), _timed(_redis(state)))
    checks = {"database": database}
    if redis is not None:
        checks["redis"] = redis
    ok = all(check["status"] == "ok" for check in checks.values())
    return JSONResponse({"status": "ready" if ok else "unavailable", "checks": checks},
                        status_code=200 if ok else 503)


async def _timed(check: Any) -> dict[str, Any] | None:
    """Run one check under the timeout: {"status": "ok", "ms": ...} or the error's type."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            ran = await check
    except Exception as error:  # any failure means "not ready"
        logger.warning("readiness check failed: %s", type(error).__name__)
        return {"status": "error", "error": type(error).__name__}
    if ran is False:
        return None  # not configured
    return {"status": "ok", "ms": round((time.perf_counter() - start) * 1000, 2)}


async def _database(state: GatewayState) -> bool:
    async with state.db.connect() as connection:
        await connection.execute(text("SELECT 1"))
    return True


async def _redis(state: GatewayState) -> bool:
    """PING on the response cache's client (the one requests use); False without Redis."""
    if not state.settings.redis_url:
        return False
    client = getattr(state.cache.exact, "redis", None)
    if client is not None:
        await client.ping()
        return True
    from redis.asyncio import from_url  # Redis configured but not for the cache: ask directly

    client = from_url(state.settings.redis_url, socket_timeout=CHECK_TIMEOUT_S,
                      socket_connect_timeout=CHECK_TIMEOUT_S)
    try:
        await client.ping()
    finally:
        await client.aclose()
    return True
