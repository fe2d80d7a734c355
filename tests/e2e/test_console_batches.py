"""The console's batches view in real headless Chromium: a live `switchboard serve` (SQLite,
a slow mock upstream, no embedded model, so it starts in seconds) runs a tenant's batch made
through the Batch API; signed in, the admin finds it from the tenant's page, sees it listed
with its status, counts and input file, cancels it from the browser (htmx, with a confirm),
and the list and the API both end at "cancelled". Screenshots as tests/e2e/test_console.py
takes them."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tenancy.migrate import upgrade
from tests.e2e.support import Gateway, gateway_env
from tests.gateway.support import (
    MockUpstream,
    Seeded,
    admin_key,
    bearer,
    mock_deployment,
    seed_tenant,
    write_deployments,
)

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.common.by import By  # noqa: E402

from tests.e2e.test_console import (  # noqa: E402
    CHROMEDRIVER,
    CHROMIUM,
    Live,
    artifacts_dir,
    headless_chromium,
    shot,
    sign_in,
    wait_for,
)

pytestmark = pytest.mark.skipif(
    not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)),
    reason=f"needs Debian chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER})")
LINES = 60  # at 200 ms each, one at a time: about 12 s, time enough to cancel


@dataclass
class Served:
    live: Live
    tenant: Seeded


async def _seed(db_url: str, tmp: Path) -> tuple[str, Seeded]:
    return (await admin_key(db_url, tmp),
            await seed_tenant(db_url, tmp, name="acme", plan={"rpm": 100_000}))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("console-batches")
    upstream = MockUpstream("--delay-ms", "200").start()
    gateway: Gateway | None = None
    db_url = f"sqlite+aiosqlite:///{tmp}/gw.db"
    try:
        upgrade(db_url)
        admin, tenant = asyncio.run(_seed(db_url, tmp))
        env = gateway_env(db_url, tmp, usage_flush_interval_s=0.1, auth_poll_interval_s=0.2,
                          files_dir=tmp / "files", batch_poll_interval_s=0.2,
                          batch_max_concurrency=1,
                          deployments_file=write_deployments(
                              tmp, [mock_deployment(upstream.base_url)]))
        gateway = Gateway(env, tmp / "gateway.log")
        url = gateway.start().url
        yield Served(Live(url, admin, tenant.key, tenant.tenant_id, artifacts_dir()), tenant)
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.stop()


@pytest.fixture(scope="module")
def browser(served: Served) -> Iterator[Any]:
    yield from headless_chromium()


def create_batch(base: str, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the input file, the batch), through the Batch API as a tenant's client makes them."""
    data = "".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "mock-model", "max_tokens": 5,
                 "messages": [{"role": "user", "content": f"line {i}"}]}}) + "\n"
        for i in range(LINES)).encode()
    with httpx.Client(base_url=base, headers=bearer(key), timeout=30) as client:
        file = client.post("/v1/files", data={"purpose": "batch"},
                           files={"file": ("nightly.jsonl", data)})
        assert file.status_code == 200, file.text
        batch = client.post("/v1/batches", json={
            "input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})
        assert batch.status_code == 200, batch.text
        return file.json(), batch.json()


def api_status(base: str, key: str, batch_id: str) -> str:
    r = httpx.get(f"{base}/v1/batches/{batch_id}", headers=bearer(key), timeout=10)
    assert r.status_code == 200, r.text
    return str(r.json()["status"])


def test_batches_view_lists_and_cancels_in_chromium(served: Served, browser: Any) -> None:
    d, live = browser, served.live
    file, batch = create_batch(live.base, served.tenant.key)
    deadline = time.monotonic() + 15
    while api_status(live.base, served.tenant.key, batch["id"]) != "in_progress":
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.1)

    sign_in(d, live, live.admin_key)
    wait_for(d, lambda d: d.current_url.endswith("/console/tenants"))
    # From the tenant's page, its Batches tab.
    d.get(f"{live.base}/console/tenants/{live.tenant_id}")
    d.find_element(By.CSS_SELECTOR, "nav.tabs a[href^='/console/batches']").click()
    wait_for(d, lambda d: f"tenant_id={live.tenant_id}" in d.current_url)
    assert d.find_element(By.TAG_NAME, "h1").text == "acme: batches"
    row_css = f"#batches-table tr[data-batch-id='{batch['id']}']"
    row = wait_for(d, lambda d: d.find_element(By.CSS_SELECTOR, row_css))
    text = row.text
    assert batch["id"] in text and "/v1/chat/completions" in text and "mock-model" in text
    assert "in_progress" in text and f"{file['bytes'] / 1024:.1f} KiB" in text
    assert d.find_element(By.CSS_SELECTOR, f"{row_css} [data-stat='total']").text == str(LINES)
    shot(d, live, "batches")
    shot(d, live, "batches", width=390)

    # Cancel from the browser: htmx posts it (CSRF header from <body>) after the confirm.
    d.find_element(By.CSS_SELECTOR, f"button[data-cancel='{batch['id']}']").click()
    wait_for(d, lambda d: d.switch_to.alert).accept()
    notice = wait_for(d, lambda d: d.find_element(By.ID, "batches-notice"))
    assert f"Batch {batch['id']} is cancel" in notice.text
    assert d.current_url.endswith(f"/console/batches?tenant_id={live.tenant_id}")
    assert api_status(live.base, served.tenant.key, batch["id"]) in ("cancelling",
                                                                     "cancelled")
    # The panel refreshes itself (every 5 s) until the worker has finished the cancel.
    wait_for(d, lambda d: d.find_element(By.CSS_SELECTOR, row_css).get_attribute(
        "data-status") == "cancelled", timeout=30)
    final = d.find_element(By.CSS_SELECTOR, row_css)
    assert not final.find_elements(By.CSS_SELECTOR, "[data-cancel]")
    completed = int(final.find_element(By.CSS_SELECTOR, "[data-stat='completed']").text)
    assert 0 < completed < LINES
    assert api_status(live.base, served.tenant.key, batch["id"]) == "cancelled"
    shot(d, live, "batches-cancelled")
