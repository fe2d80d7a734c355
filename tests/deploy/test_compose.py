"""No Docker engine here: check the compose file and its deployments parse and fit together."""

from __future__ import annotations

from pathlib import Path

import yaml

from gateway.deployments import load_deployments_file

REPO = Path(__file__).resolve().parents[2]


def test_compose_services_and_wiring():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "gateway-1", "gateway-2", "worker-cpu", "worker-gpu"} <= set(
        services)
    for name in ("gateway-1", "gateway-2"):
        env = services[name]["environment"]
        assert env["SWITCHBOARD_DATABASE_URL"].startswith("postgresql+asyncpg://")
        assert env["SWITCHBOARD_REDIS_URL"] == "redis://redis:6379/0"
        assert set(services[name]["depends_on"]) == {"postgres", "redis"}
    assert services["worker-gpu"]["profiles"] == ["gpu"]


def test_compose_deployments_config_is_valid(tmp_path):
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    path = tmp_path / "deployments.yaml"
    path.write_text(compose["configs"]["deployments"]["content"])
    [worker] = load_deployments_file(path)
    assert worker.base_url == "http://worker-cpu:8001/v1"
    assert worker.provider == "worker"
