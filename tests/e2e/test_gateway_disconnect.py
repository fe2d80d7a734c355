"""A client that leaves before the upstream answers: the gateway notices, aborts and settles."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from tests.dbutil import migrated_database
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


@pytest.mark.parametrize("stream", [True, False])
async def test_leaving_while_waiting_aborts_and_frees_the_slot(tmp_path, stream):
    upstream = MockUpstream("--delay-ms", "4000").start()
    proc = None
    try:
        async with migrated_database("sqlite", tmp_path) as db_url:
            await admin_key(db_url, tmp_path)
            t = await seed_tenant(db_url, tmp_path, name="leaver", plan={"max_concurrent": 1})
            port = free_port()
            env = {**os.environ, "PYTHONPATH": str(REPO), "SWITCHBOARD_DATABASE_URL": db_url,
                   "SWITCHBOARD_SECRET_KEY": SECRET, "SWITCHBOARD_EMBEDDED_MODEL": "none",
                   "SWITCHBOARD_USAGE_FLUSH_INTERVAL_S": "0.1",
                   "SWITCHBOARD_USAGE_OUTBOX_DIR": str(tmp_path / "outbox"),
                   "SWITCHBOARD_DEPLOYMENTS_FILE": str(write_deployments(
                       tmp_path, [mock_deployment(upstream.base_url)]))}
            proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port",
                                     str(port)], cwd=REPO, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            base = f"http://127.0.0.1:{port}"
            wait_http(f"{base}/health", timeout_s=60, proc=proc)
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
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        upstream.stop()
