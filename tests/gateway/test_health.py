"""Liveness and readiness, on both database backends, with and without Redis."""

from __future__ import annotations

from pathlib import Path

from tests.dbutil import drop_postgres, migrated_database
from tests.gateway.support import free_port, gateway_client, ok, settings

REDIS_URL = "redis://127.0.0.1:6379/0"


async def test_live_and_ready(db_url: str, tmp_path: Path) -> None:
    async with gateway_client(settings(db_url, tmp_path)) as client:
        assert ok(await client.get("/health/live")) == {"status": "ok"}
        body = ok(await client.get("/health/ready"))
        assert body["status"] == "ready"
        assert body["checks"]["database"]["status"] == "ok"
        assert "redis" not in body["checks"]  # not configured: not checked
        assert ok(await client.get("/health"))["status"] == "ok"  # the old endpoint stays


async def test_ready_checks_redis(sqlite_url: str, tmp_path: Path) -> None:
    async with gateway_client(settings(sqlite_url, tmp_path, redis_url=REDIS_URL)) as client:
        body = ok(await client.get("/health/ready"))
        assert body["checks"]["redis"]["status"] == "ok"


async def test_not_ready_when_redis_is_unreachable(sqlite_url: str, tmp_path: Path) -> None:
    """A Redis URL on a port nothing listens on: the gateway starts (fail-open limiter, caches
    that connect on first use), lives, but is not ready."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with gateway_client(settings(sqlite_url, tmp_path, redis_url=dead)) as client:
        assert ok(await client.get("/health/live")) == {"status": "ok"}
        response = await client.get("/health/ready")
        body = ok(response, 503)
        assert body["status"] == "unavailable"
        assert body["checks"]["database"]["status"] == "ok"
        assert body["checks"]["redis"]["status"] == "error"
        assert str(dead) not in response.text


async def test_not_ready_when_the_database_goes_away(tmp_path: Path) -> None:
    """The gateway's PostgreSQL database is dropped under it (connections terminated):
    ready turns 503 at once, live stays 200, and the answer does not leak the URL."""
    async with migrated_database("postgres", tmp_path) as url, \
            gateway_client(settings(url, tmp_path)) as client:
        ok(await client.get("/health/ready"))
        await drop_postgres(url)
        response = await client.get("/health/ready")
        body = ok(response, 503)
        assert body["checks"]["database"]["status"] == "error"
        assert body["checks"]["database"]["error"]
        assert url.split("@")[-1] not in response.text
        assert ok(await client.get("/health/live")) == {"status": "ok"}
