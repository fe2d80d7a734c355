"""The admin console in real headless Chromium (Debian `chromium` + `chromium-driver`).

A live `switchboard serve` configured as `make serve` runs it (SQLite, the embedded SmolLM2
engine and the in-process embedding model both on), plus a mock upstream for quick API
calls, and a browser driven by selenium: sign in, create a tenant and a key (shown once),
call the API with the key via the `openai` client, watch the usage table and chart update,
revoke the key (the next call is a 401), sign out. Also: a change without the CSRF token is
a 403 in the browser, a tenant key cannot sign in, and every console page renders (200, no
error, its own element) with every kind of deployment present. Screenshots of each page go
to `SWITCHBOARD_TEST_ARTIFACTS` (or tests/artifacts/console/), at 1280 px and at a 390 px
phone width.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tenancy.migrate import upgrade
from tests.e2e.support import Gateway, gateway_env
from tests.gateway.support import (
    REPO,
    MockUpstream,
    admin_key,
    mock_deployment,
    seed_tenant,
    write_deployments,
)

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.common.exceptions import (  # noqa: E402
    NoAlertPresentException,
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = os.environ.get("SWITCHBOARD_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SWITCHBOARD_CHROMEDRIVER", "/usr/bin/chromedriver")
pytestmark = pytest.mark.skipif(
    not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)),
    reason=f"needs Debian chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER})")
CHAT = [{"role": "user", "content": "hi"}]


@dataclass
class Live:
    base: str
    admin_key: str
    tenant_key: str  # another tenant's key: must not open the console
    tenant_id: str  # that tenant's id (its console pages)
    artifacts: Path


def artifacts_dir() -> Path:
    folder = Path(os.environ.get("SWITCHBOARD_TEST_ARTIFACTS", REPO / "tests" / "artifacts"))
    folder = folder / "console"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def _seed(db_url: str, tmp: Path) -> tuple[str, str, str]:
    key = await admin_key(db_url, tmp)
    other = await seed_tenant(db_url, tmp, name="other-tenant")
    return key, other.key, other.tenant_id


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Live]:
    """`make serve`'s configuration: the default embedded model and the default embedding
    model (smollm2_path converts the former once, before the server starts)."""
    tmp = tmp_path_factory.mktemp("console")
    upstream = MockUpstream().start()
    gateway: Gateway | None = None
    db_url = f"sqlite+aiosqlite:///{tmp}/gw.db"
    try:
        upgrade(db_url)
        admin, tenant, tenant_id = asyncio.run(_seed(db_url, tmp))
        env = gateway_env(db_url, tmp, usage_flush_interval_s=0.1, auth_poll_interval_s=0.2,
                          embedded={"model": "default", "kv_cache_memory": 128 << 20},
                          embedding_model="default",
                          deployments_file=write_deployments(
                              tmp, [mock_deployment(upstream.base_url)]))
        gateway = Gateway(env, tmp / "gateway.log")
        yield Live(gateway.start(timeout_s=180).url, admin, tenant, tenant_id, artifacts_dir())
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.stop()


def headless_chromium() -> Iterator[Any]:
    """Debian's Chromium, headless, through its ChromeDriver; quit when the caller is done."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-background-networking", "--window-size=1280,1000",
                 "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def browser(live: Live) -> Iterator[Any]:
    yield from headless_chromium()


def wait_for(driver: Any, check: Callable[[Any], Any], timeout: float = 15) -> Any:
    """Until `check` is truthy; an element htmx swapped out meanwhile just means "again"."""
    return WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=(
        NoAlertPresentException, NoSuchElementException, StaleElementReferenceException,
    )).until(check)


def shot(driver: Any, live: Live, name: str, *, width: int = 1280) -> None:
    """A full-height screenshot at a given width (390: a phone, as a phone reports it)."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": max(int(height), 700), "deviceScaleFactor": 1,
        "mobile": width < 600})
    if width < 600:  # re-measure: the layout is taller when narrow
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": max(int(height), 700), "deviceScaleFactor": 1,
            "mobile": True})
    time.sleep(0.3)  # let charts resize
    driver.save_screenshot(str(live.artifacts / f"{name}-{width}.png"))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def client(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base}/v1", api_key=key, max_retries=0, timeout=30)


def chart_total(driver: Any) -> float:
    return driver.execute_script(
        "const c = Chart.getChart('tokens-chart');"
        "return c ? c.data.datasets.flatMap(d => d.data).reduce((a, b) => a + b, 0) : -1;")


def sign_in(driver: Any, live: Live, key: str) -> None:
    driver.get(f"{live.base}/console/login")
    driver.find_element(By.ID, "admin-key").send_keys(key)
    driver.find_element(By.ID, "sign-in").click()


def test_console_flow_in_chromium(live: Live, browser: Any) -> None:
    d = browser
    # 1. Sign in (the console sends a signed-out visitor to the sign-in page first).
    d.get(f"{live.base}/console/tenants")
    wait_for(d, lambda d: "/console/login" in d.current_url)
    shot(d, live, "login")
    sign_in(d, live, live.admin_key)
    wait_for(d, lambda d: d.current_url.endswith("/console/tenants"))
    cookie = d.get_cookie("sb_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"

    # 2. A tenant and a key; the key is shown once.
    d.find_element(By.CSS_SELECTOR, "#create-tenant input[name=name]").send_keys("acme")
    d.find_element(By.CSS_SELECTOR, "#create-tenant button[type=submit]").click()
    wait_for(d, lambda d: d.find_element(By.TAG_NAME, "h1").text.startswith("acme"))
    shot(d, live, "tenant")
    d.find_element(By.LINK_TEXT, "API keys").click()
    wait_for(d, lambda d: d.current_url.endswith("/keys"))
    d.find_element(By.CSS_SELECTOR, "#create-key input[name=name]").send_keys("production")
    d.find_element(By.CSS_SELECTOR, "#create-key input[name=rpm]").send_keys("100")
    d.find_element(By.CSS_SELECTOR, "#create-key button[type=submit]").click()
    key = wait_for(d, lambda d: d.find_element(By.ID, "new-key-value").text)
    assert key.startswith("sk-sb-") and not key.startswith("sk-sb-admin-")
    d.find_element(By.ID, "copy-key").click()
    wait_for(d, lambda d: d.find_element(By.ID, "copy-key").text == "Copied")
    shot(d, live, "keys")
    d.refresh()
    wait_for(d, lambda d: d.find_elements(By.ID, "keys-table"))
    assert not d.find_elements(By.ID, "new-key-value") and key not in d.page_source

    # The usage page before any traffic: an empty chart.
    d.get(f"{live.base}/console/usage")
    wait_for(d, lambda d: chart_total(d) == 0)

    # 3. The API with the new key, through the official client.
    reply = client(live, key).chat.completions.create(model="mock-model", messages=CHAT,
                                                      max_tokens=5)
    assert reply.usage.total_tokens > 0

    # 4. The usage table and the chart update by themselves (htmx refresh of the panel).
    wait_for(d, lambda d: chart_total(d) > 0, timeout=30)
    wait_for(d, lambda d: "acme" in d.find_element(By.ID, "top-tenants").text)
    wait_for(d, lambda d: d.find_element(By.ID, "kpi-requests").text == "1")
    shot(d, live, "usage")
    shot(d, live, "usage", width=390)

    # A change without the CSRF token, from the signed-in page itself: 403, nothing made.
    status = d.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/console/tenants', {method: 'POST', body: new URLSearchParams("
        "{name: 'forged', plan_id: '__new__'})}).then(r => done(r.status));")
    assert status == 403
    d.get(f"{live.base}/console/tenants")
    assert "forged" not in d.find_element(By.ID, "tenants-table").text
    shot(d, live, "tenants")
    shot(d, live, "tenants", width=390)

    for page, marker in (("deployments", "deployments-table"), ("workers", "workers-panel")):
        d.get(f"{live.base}/console/{page}")
        wait_for(d, lambda d, marker=marker: d.find_elements(By.ID, marker))
        shot(d, live, page)

    # 5. Revoke the key in the console; the next API call is a 401.
    d.get(f"{live.base}/console/tenants")
    d.find_element(By.LINK_TEXT, "acme").click()
    d.find_element(By.LINK_TEXT, "API keys").click()
    d.find_element(By.CSS_SELECTOR, "button[data-revoke]").click()
    wait_for(d, lambda d: d.switch_to.alert).accept()
    wait_for(d, lambda d: "revoked" in d.find_element(By.ID, "keys-table").text)
    shot(d, live, "keys-revoked", width=390)
    with pytest.raises(openai.AuthenticationError):
        client(live, key).chat.completions.create(model="mock-model", messages=CHAT,
                                                  max_tokens=5)

    # 6. Sign out: the console is closed again.
    d.find_element(By.ID, "logout").click()
    wait_for(d, lambda d: "/console/login" in d.current_url)
    d.get(f"{live.base}/console/tenants")
    wait_for(d, lambda d: "/console/login" in d.current_url)
    assert d.get_cookie("sb_console") is None


def test_tenant_key_cannot_reach_the_console(live: Live, browser: Any) -> None:
    d = browser
    d.delete_all_cookies()
    sign_in(d, live, live.tenant_key)
    error = wait_for(d, lambda d: d.find_element(By.ID, "login-error"))
    assert "Tenant API keys cannot sign in" in error.text
    assert d.get_cookie("sb_console") is None
    shot(d, live, "login-refused", width=390)
    d.get(f"{live.base}/console/usage")
    wait_for(d, lambda d: "/console/login" in d.current_url)


def status_of(driver: Any, path: str) -> int:
    """The HTTP status of a GET of `path` from the signed-in page (its cookie goes along);
    a redirect reads as 0."""
    return driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0], {redirect: 'manual'}).then(r => done(r.status), () => done(-1));",
        path)


def assert_renders(driver: Any, live: Live, path: str, marker: str) -> None:
    """`path` opens in the browser: its own element shows, no error page or error text, and
    a GET of it is a 200."""
    driver.get(f"{live.base}{path}")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, marker))
    assert not driver.find_elements(By.ID, "error-page"), path
    source = driver.page_source
    for text in ("Internal Server Error", "Traceback", "has no attribute"):
        assert text not in source, (path, text)
    assert status_of(driver, path) == 200, path


def test_every_console_page_renders(live: Live, browser: Any) -> None:
    """Each console page, on `make serve`'s deployments (the embedded engine, the embedding
    model) and an HTTP upstream: the workers page shows each with the figures it has."""
    d = browser
    d.get(f"{live.base}/console/login")
    d.delete_all_cookies()
    assert_renders(d, live, "/console/login", "#admin-key")
    sign_in(d, live, live.admin_key)
    wait_for(d, lambda d: d.current_url.endswith("/console/tenants"))
    tenant = f"/console/tenants/{live.tenant_id}"
    for path, marker in (
            ("/console/tenants", "#tenants-table"),
            (tenant, "#limits-form"),
            (f"{tenant}/keys", "#keys-table"),
            (f"{tenant}/adapters", "form[action$='/adapters/upload']"),
            ("/console/usage", "#tokens-chart"),
            ("/console/deployments", "#deployments-table"),
            ("/console/workers", "#workers-panel")):
        assert_renders(d, live, path, marker)

    # The workers page: a card per deployment, each with only the figures its kind reports.
    cards = {c.get_attribute("data-worker"): c.get_attribute("data-kind")
             for c in d.find_elements(By.CSS_SELECTOR, "[data-worker]")}
    assert cards == {"embedded": "embedded engine", "embedded-embedding": "embedding model",
                     "mock": "HTTP upstream"}

    def stats(name: str) -> set[str]:
        return {e.get_attribute("data-stat") for e in d.find_elements(
            By.CSS_SELECTOR, f"[data-worker='{name}'] [data-stat]")}

    assert {"num_waiting", "kv_cache_usage"} <= stats("embedded")
    assert stats("embedded-embedding") == {"queued_rows"}
    assert stats("mock") == set()
    assert status_of(d, "/console/workers/panel") == 200  # what the page polls
    time.sleep(2.5)  # one poll has swapped the panel in again
    assert d.find_elements(By.CSS_SELECTOR, "#workers-panel [data-worker='embedded-embedding']")
    assert "Internal Server Error" not in d.page_source
