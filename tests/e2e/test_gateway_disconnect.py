"""A client that leaves before the upstream answers: the gateway notices, aborts and settles."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest

from tests.dbutil import migrated_database
from tests.e2e.support import Gateway, gateway_env
from tests.gateway.support import (
    MockUpstream,
    admin_key,
    mock_deployment,
    seed_tenant,
    write_deployments,
)


@pytest.mark.parametrize("stream", [True, False])
async def test_leaving_while_waiting_aborts_and_frees_the_slot(tmp_path, stream):
    upstream = MockUpstream("--delay-ms", "4000").start()
    gateway: Gateway | None = None
    try:
        async with migrated_database("sqlite", tmp_path) as db_url:
            await admin_key(db_url, tmp_path)
            t = await seed_tenant(db_url, tmp_path, name="leaver", plan={"max_concurrent": 1})
            gateway = Gateway(gateway_env(
                db_url, tmp_path, usage_flush_interval_s=0.1, deployments_file=write_deployments(
                    tmp_path, [mock_deployment(upstream.base_url)])), tmp_path / "gateway.log")
            base = gateway.start(timeout_s=60).url
            headers = {"authorization": f"Bearer {t.key}"}
            body = {"model": "mock-model", "stream": stream,
                    "messages": [{"role": "user", "content": "hi"}]}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers,
                           timeout=httpx.Timeout(5, read=0.5))
            left = time.monotonic()
            db_path = db_url.split("///", 1)[1]
            rows: list[tuple[str]] = []
            while time.monotonic() - left < 3 and not rows:
                with sqlite3.connect(db_path) as db:
                    rows = db.execute("select status from usage_records").fetchall()
                time.sleep(0.05)
            assert rows == [("aborted",)]  # well before the upstream's 4 s answer
            # The one concurrency slot is free again at once.
            quick = {**body, "stream": False}
            r = httpx.post(f"{base}/v1/chat/completions", json=quick, headers=headers,
                           timeout=10)
            assert r.status_code == 200
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.stop()
