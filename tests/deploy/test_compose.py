"""No Docker engine here: check that docker-compose.yml and the files it mounts parse and fit
together (services, start order, health checks, proxy, Prometheus, traces, settings)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.deployments.config import load_routing_file
from gateway.settings import Settings
from tests.deploy.support import REPO, parse_worker_args, unknown_env_names

GATEWAYS = ("gateway-1", "gateway-2")
WORKERS = ("worker-cpu", "worker-gpu")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def mounted_file(service: dict[str, Any], target: str) -> Path:
    """The repository file a service bind-mounts at `target`."""
    for volume in service.get("volumes", []):
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target:
            assert source.startswith("./"), volume
            path = REPO / source[2:]
            assert path.is_file(), f"{path} is mounted but missing"
            return path
    raise AssertionError(f"nothing mounted at {target}")


def port_of(service: dict[str, Any]) -> int:
    command = service["command"]
    return int(command[command.index("--port") + 1])


def test_services(services: dict[str, Any]) -> None:
    assert {"postgres", "redis", "migrate", *GATEWAYS, "proxy", *WORKERS, "prometheus",
            "otel-collector"} <= set(services)
    # Only the GPU worker waits for a profile; everything else comes up by default.
    assert services["worker-gpu"]["profiles"] == ["gpu"]
    assert all("profiles" not in s for name, s in services.items() if name != "worker-gpu")


def test_gpu_worker_reserves_an_nvidia_gpu(services: dict[str, Any]) -> None:
    gpu = services["worker-gpu"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device["count"] == 1
    assert gpu["build"]["args"]["TORCH_SPEC"] == "torch"  # the CUDA build, not the CPU pin
    args = parse_worker_args(gpu["command"][2:])
    assert args.device == "cuda"
    assert "deploy" not in services["worker-cpu"]


def test_health_checks(services: dict[str, Any]) -> None:
    """Every long-running service has one, except the collector (its image has no shell or
    HTTP client). Ours probe their own readiness endpoints on the port they serve."""
    for name, service in services.items():
        if name in ("otel-collector", "migrate"):
            continue
        test = service["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), name
    assert services["migrate"]["healthcheck"] == {"disable": True}
    for name in (*GATEWAYS, *WORKERS):
        service = services[name]
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "switchboard-probe", "http"], name
        url = urlsplit(test[3])
        assert url.path == "/health/ready"
        assert url.port == port_of(service)


def test_start_order(services: dict[str, Any]) -> None:
    """Migrations run once, in their own service, before any gateway starts."""
    assert services["migrate"]["command"] == ["switchboard", "migrate"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    for name in GATEWAYS:
        gateway = services[name]
        depends = {k: v["condition"] for k, v in gateway["depends_on"].items()}
        assert depends["migrate"] == "service_completed_successfully"
        assert depends["postgres"] == depends["redis"] == "service_healthy"
        env = gateway["environment"]
        assert env["SWITCHBOARD_MIGRATE_ON_START"] == "false"
        assert Settings(migrate_on_start=env["SWITCHBOARD_MIGRATE_ON_START"]).migrate_on_start \
            is False
        assert gateway["command"] == ["switchboard", "serve", "--host", "0.0.0.0",
                                      "--port", "8000"]
    for name in WORKERS:
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in GATEWAYS:
        assert services["proxy"]["depends_on"][name]["condition"] == "service_healthy"


def test_gateways_share_one_database_redis_and_secrets(services: dict[str, Any]) -> None:
    envs = [services[name]["environment"] for name in GATEWAYS]
    assert envs[0] == envs[1]
    env = envs[0]
    assert env["SWITCHBOARD_DATABASE_URL"].startswith("postgresql+asyncpg://")
    assert urlsplit(env["SWITCHBOARD_DATABASE_URL"]).hostname == "postgres"
    assert env["SWITCHBOARD_DATABASE_URL"] == \
        services["migrate"]["environment"]["SWITCHBOARD_DATABASE_URL"]
    assert env["SWITCHBOARD_REDIS_URL"] == "redis://redis:6379/0"
    assert env["SWITCHBOARD_EMBEDDED__MODEL"] == "none"
    # Secrets come from the operator's environment; compose refuses to start without them.
    for key in ("SWITCHBOARD_SECRET_KEY", "SWITCHBOARD_WORKER_SECRET",
                "SWITCHBOARD_METRICS_TOKEN"):
        assert env[key].startswith(f"${{{key}:?"), key
    # Gateways and workers share the worker secret.
    for name in WORKERS:
        assert services[name]["environment"]["SWITCHBOARD_WORKER_SECRET"] == \
            env["SWITCHBOARD_WORKER_SECRET"]
    # The usage outbox is on a volume.
    outbox = env["SWITCHBOARD_USAGE_OUTBOX_DIR"]
    assert any(v.split(":")[1] == outbox for v in services["gateway-1"]["volumes"])
    # Workers load tenants' adapters by the path the gateway stored them at: same volume,
    # same mount point.
    adapters = env["SWITCHBOARD_ADAPTER_DIR"]
    [volume] = [v.split(":")[0] for v in services["gateway-1"]["volumes"]
                if v.split(":")[1] == adapters]
    for name in WORKERS:
        assert f"{volume}:{adapters}:ro" in services[name]["volumes"]
    # Batches resume on any replica: their files are on one volume the gateways share.
    files = env["SWITCHBOARD_FILES_DIR"]
    mounts = [{v for v in services[name]["volumes"] if v.split(":")[1] == files}
              for name in ("gateway-1", "gateway-2")]
    assert mounts[0] and mounts[0] == mounts[1]


def test_every_setting_is_real(services: dict[str, Any]) -> None:
    """A misspelt variable would be silently ignored (extra="ignore"): every SWITCHBOARD_*
    name must be a Settings field or read by the code directly."""
    names = {key for s in services.values() for key in (s.get("environment") or {})}
    assert {"SWITCHBOARD_DATABASE_URL", "SWITCHBOARD_OTEL_ENDPOINT"} <= names
    assert unknown_env_names(names) == set()


def test_env_values_parse_as_settings(services: dict[str, Any]) -> None:
    for name in (*GATEWAYS, *WORKERS, "migrate"):
        env = services[name]["environment"]
        values = {k.removeprefix("SWITCHBOARD_").lower(): v for k, v in env.items()
                  if k.startswith("SWITCHBOARD_") and "${" not in v}
        Settings(**values)  # raises on a value of the wrong type or an unknown choice


def test_workers_register_and_advertise_themselves(services: dict[str, Any]) -> None:
    for name in WORKERS:
        service = services[name]
        assert service["command"][:2] == ["switchboard", "worker"]
        args = parse_worker_args(service["command"][2:])
        assert args.host == "0.0.0.0"
        assert args.register_redis == "redis://redis:6379/0"
        advertise = urlsplit(args.advertise_url)
        assert (advertise.hostname, advertise.port) == (name, args.port)
        assert args.worker_id == name
        assert args.served_model_name == "smollm2-135m-instruct"
        assert str(args.port) in service["expose"]
        assert "SWITCHBOARD_DATABASE_URL" not in service["environment"]  # Redis only


def test_deployments_config_discovers_workers(compose: dict[str, Any], tmp_path: Path) -> None:
    """The gateways' routing file loads with the gateway's own loader and names the model the
    workers serve. Needs `discover` in DeploymentConfig (worker discovery through Redis)."""
    path = tmp_path / "deployments.yaml"
    path.write_text(compose["configs"]["deployments"]["content"])
    [deployment] = load_routing_file(path).deployments
    assert deployment.provider == "worker"
    assert deployment.discover is True
    assert deployment.base_url is None
    served = {parse_worker_args(compose["services"][n]["command"][2:]).served_model_name
              for n in WORKERS}
    assert served == {deployment.model_name} == {deployment.upstream_model}
    for name in GATEWAYS:
        [config] = compose["services"][name]["configs"]
        assert config["source"] == "deployments"
        assert config["target"] == compose["services"][name]["environment"][
            "SWITCHBOARD_DEPLOYMENTS_FILE"]


def test_proxy_balances_both_gateways_and_streams(services: dict[str, Any]) -> None:
    proxy = services["proxy"]
    assert proxy["ports"] == ["8080:8080"]
    conf = re.sub(r"#[^\n]*", "", mounted_file(proxy, "/etc/nginx/nginx.conf").read_text())
    assert conf.count("{") == conf.count("}")
    [upstream] = re.findall(r"upstream\s+(\w+)\s*\{([^}]*)\}", conf)
    name, body = upstream
    servers = re.findall(r"^\s*server\s+([\w.-]+):(\d+)", body, re.MULTILINE)
    assert sorted(servers) == [(g, "8000") for g in GATEWAYS]
    assert f"proxy_pass http://{name};" in conf
    assert re.search(r"listen\s+8080;", conf)
    # Server-sent events pass through at once, and a long generation is not cut off.
    assert re.search(r"proxy_buffering\s+off;", conf)
    assert re.search(r"proxy_http_version\s+1\.1;", conf)
    read_timeout = int(re.search(r"proxy_read_timeout\s+(\d+)s;", conf).group(1))
    assert read_timeout > Settings().upstream_timeout_s
    # No sticky sessions (console sessions are in Redis), and never a resent POST.
    assert "ip_hash" not in conf and "sticky" not in conf
    assert "non_idempotent" not in conf
    # The proxy's own health endpoint is what its healthcheck probes.
    assert "/proxy-health" in " ".join(proxy["healthcheck"]["test"])
    assert "location = /proxy-health" in conf


def test_prometheus_scrapes_every_gateway_and_worker(compose: dict[str, Any],
                                                     services: dict[str, Any]) -> None:
    prometheus = services["prometheus"]
    config = yaml.safe_load(mounted_file(prometheus, "/etc/prometheus/prometheus.yml")
                            .read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    secrets = compose["secrets"]

    def targets(job: dict[str, Any]) -> set[tuple[str, int]]:
        return {(t.split(":")[0], int(t.split(":")[1]))
                for group in job["static_configs"] for t in group["targets"]}

    def token_variable(job: dict[str, Any]) -> str:
        """The environment variable the job's bearer token file is filled from."""
        auth = job["authorization"]
        assert auth["type"] == "Bearer"
        secret = auth["credentials_file"].removeprefix("/run/secrets/")
        assert secret in prometheus["secrets"]
        return secrets[secret]["environment"]

    gateway_job, worker_job = jobs["switchboard-gateway"], jobs["switchboard-worker"]
    assert targets(gateway_job) == {(g, port_of(services[g])) for g in GATEWAYS}
    assert targets(worker_job) == {(w, port_of(services[w])) for w in WORKERS}
    assert gateway_job.get("metrics_path", "/metrics") == "/metrics"
    assert worker_job.get("metrics_path", "/metrics") == "/metrics"
    assert token_variable(gateway_job) == "SWITCHBOARD_METRICS_TOKEN"
    assert token_variable(worker_job) == "SWITCHBOARD_WORKER_SECRET"


def test_traces_reach_the_collector(services: dict[str, Any]) -> None:
    collector = services["otel-collector"]
    config = yaml.safe_load(mounted_file(collector, "/etc/otelcol/config.yaml").read_text())
    http = urlsplit("//" + config["receivers"]["otlp"]["protocols"]["http"]["endpoint"])
    assert http.port == 4318
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    assert "debug" in pipeline["exporters"]
    assert set(pipeline["exporters"]) <= set(config["exporters"])
    assert set(pipeline.get("processors", [])) <= set(config["processors"])
    for name in (*GATEWAYS, *WORKERS):
        env = services[name]["environment"]
        assert env["SWITCHBOARD_OTEL_EXPORTER"] == "otlp"
        endpoint = urlsplit(env["SWITCHBOARD_OTEL_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port, endpoint.path) == \
            ("otel-collector", http.port, "/v1/traces")
        assert str(http.port) in collector["expose"]


def test_dockerfile_ships_the_probe() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = re.search(r"^COPY (deploy/\S+) /usr/local/bin/switchboard-probe$", dockerfile,
                       re.MULTILINE)
    assert copied and (REPO / copied.group(1)).is_file()
    assert 'HEALTHCHECK' in dockerfile
    assert re.search(r'^CMD \["switchboard", "serve"', dockerfile, re.MULTILINE)
    # Every file a service builds from or mounts is in the repository.
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        build = service.get("build")
        if build is not None:
            context = build if isinstance(build, str) else build["context"]
            assert (REPO / context / "Dockerfile").is_file()
