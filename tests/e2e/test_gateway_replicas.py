"""Three live gateway processes on one PostgreSQL and one Redis: limits stay exact."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter

import httpx
import pytest

from tests.dbutil import migrated_database, postgres_available
from tests.gateway.support import (
    REPO,
    SECRET,
    MockUpstream,
    admin_key,
    free_port,
    mock_deployment,
    seed_tenant,
    wait_http,
    write_deployments,
)

REPLICAS = 3
BURST = 200
CHAT = [{"role": "user", "content": "hi"}]


async def test_rpm_exact_across_three_gateways(tmp_path):
    if not await postgres_available():
        pytest.skip("PostgreSQL is not running on 127.0.0.1:5432")
    upstream = MockUpstream().start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        async with migrated_database("postgres", tmp_path) as db_url:
            await admin_key(db_url, tmp_path)  # so no replica races to bootstrap one
            limited = await seed_tenant(db_url, tmp_path, name="limited", plan={"rpm": 50})
            other = await seed_tenant(db_url, tmp_path, name="other", plan={"rpm": 1000})
            env = {
                **os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                "SWITCHBOARD_DATABASE_URL": db_url, "SWITCHBOARD_SECRET_KEY": SECRET,
                "SWITCHBOARD_USAGE_OUTBOX_DIR": str(tmp_path / "outbox"),
                "SWITCHBOARD_REDIS_URL": "redis://127.0.0.1:6379/0",
                "SWITCHBOARD_REDIS_FAIL_OPEN": "false", "SWITCHBOARD_EMBEDDED_MODEL": "none",
                # A loaded CI machine must not turn slow Redis answers into refusals.
                "SWITCHBOARD_REDIS_TIMEOUT_S": "10",
                "SWITCHBOARD_LOG_LEVEL": "warning",
                "SWITCHBOARD_DEPLOYMENTS_FILE": str(write_deployments(
                    tmp_path, [mock_deployment(upstream.base_url)])),
            }
            ports = [free_port() for _ in range(REPLICAS)]
            procs = [subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port",
                                       str(port)], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for port in ports]
            for port, proc in zip(ports, procs, strict=True):
                wait_http(f"http://127.0.0.1:{port}/health", timeout_s=60, proc=proc)

            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(
                    max_connections=BURST)) as client:
                async def call(i: int, key: str) -> int:
                    r = await client.post(
                        f"http://127.0.0.1:{ports[i % REPLICAS]}/v1/chat/completions",
                        json={"model": "mock-model", "messages": CHAT, "max_tokens": 5},
                        headers={"authorization": f"Bearer {key}"})
                    return r.status_code

                statuses = Counter(await asyncio.gather(
                    *[call(i, limited.key) for i in range(BURST)]))
                assert statuses == {200: 50, 429: BURST - 50}
                # Another tenant is untouched by the first one's exhaustion.
                assert await call(0, other.key) == 200
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
        upstream.stop()
