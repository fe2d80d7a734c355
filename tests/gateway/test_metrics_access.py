"""Who may scrape /metrics: the token when set; without one, only a loopback-bound gateway."""

from __future__ import annotations

import logging

import pytest

from gateway.addresses import is_loopback
from gateway.routes.metrics import announce_metrics_access
from gateway.settings import Settings
from tests.gateway.support import bearer, gateway_client, settings


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
    ("gateway.example", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(("host", "token", "sent", "status"), [
    ("127.0.0.1", "", None, 200),  # loopback, no token: open as before
    ("0.0.0.0", "", None, 403),  # bound beyond loopback without a token: refused
    ("0.0.0.0", "s3cret", None, 401),
    ("0.0.0.0", "s3cret", "wrong", 401),
    ("0.0.0.0", "s3cret", "s3cret", 200),
    ("127.0.0.1", "s3cret", None, 401),  # a token, once set, is always required
])
async def test_metrics_access(sqlite_url, tmp_path, host, token, sent, status):
    cfg = settings(sqlite_url, tmp_path, host=host, metrics_token=token)
    async with gateway_client(cfg) as client:
        r = await client.get("/metrics", headers=bearer(sent) if sent else {})
    assert r.status_code == status
    if status == 403:
        assert r.json()["error"]["code"] == "metrics_token_required"


def test_start_says_who_may_scrape(caplog):
    caplog.set_level(logging.INFO, logger="gateway.routes.metrics")
    announce_metrics_access(Settings(host="0.0.0.0", metrics_token=""))
    announce_metrics_access(Settings(host="127.0.0.1", metrics_token=""))
    announce_metrics_access(Settings(host="0.0.0.0", metrics_token="t"))
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records] == [
        (logging.WARNING, "/metrics is refused"),
        (logging.INFO, "/metrics is open on loopback (127.0.0.1); set SWITCHBOARD_METRICS_TOKEN "
                       "before binding elsewhere"),
        (logging.INFO, "/metrics requires the metrics token")]
