"""No cluster here: check that the Kubernetes manifests in deploy/k8s parse and fit together
(probes, resources, GPU scheduling, HPA and Service targets, secrets, settings)."""

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

K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
OPTIONAL = K8S / "optional"
SECRET_EXAMPLE = K8S / "secret.example.yaml"


def load_dir(folder: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        path = folder / resource
        if path.is_dir():
            continue  # a base, loaded on its own
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return load_dir(BASE)


@pytest.fixture(scope="module")
def everything(base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return base + load_dir(OPTIONAL)


@pytest.fixture(scope="module")
def secret() -> dict[str, Any]:
    return yaml.safe_load(SECRET_EXAMPLE.read_text())


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(workload: dict[str, Any], *, init: bool = False) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("containers", []) + (spec.get("initContainers", []) if init else [])


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def arg_value(args: list[str], flag: str) -> int:
    """The integer value of `--flag N` or `--flag=N`."""
    for i, arg in enumerate(args):
        if arg == flag:
            return int(args[i + 1])
        if arg.startswith(f"{flag}="):
            return int(arg.split("=", 1)[1])
    raise AssertionError(f"{flag} missing from {args}")


def env_names(container: dict[str, Any], configmaps: dict[str, Any],
              secret: dict[str, Any]) -> set[str]:
    names = {e["name"] for e in container.get("env", [])}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            names |= set(configmaps[source["configMapRef"]["name"]]["data"])
        else:
            assert source["secretRef"]["name"] == secret["metadata"]["name"]
            names |= set(secret["stringData"])
    return names


def test_kustomization_lists_every_manifest() -> None:
    for folder in (BASE, OPTIONAL):
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
        listed = {r for r in kustomization["resources"] if not (folder / r).is_dir()}
        present = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == present, folder
    # The example Secret is never applied with the rest (placeholders only).
    assert "secret.example.yaml" not in (BASE / "kustomization.yaml").read_text().split(
        "resources:")[1]


def test_workloads(base: list[dict[str, Any]]) -> None:
    deployments = of_kind(base, "Deployment")
    assert set(deployments) == {"switchboard-gateway", "switchboard-worker-gpu",
                                "switchboard-worker-cpu"}
    assert "switchboard-migrate" in of_kind(base, "Job")
    assert of_kind(base, "Namespace")


def test_every_deployment_has_probes_and_requests(base: list[dict[str, Any]]) -> None:
    for name, deployment in of_kind(base, "Deployment").items():
        spec = deployment["spec"]
        assert selects(spec["selector"]["matchLabels"], pod_labels(deployment)), name
        for container in containers(deployment):
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            ready, live = container["readinessProbe"], container["livenessProbe"]
            assert ready["httpGet"]["path"] == "/health/ready", name
            assert live["httpGet"]["path"] == "/health/live", name
            for probe in (ready, live, container["startupProbe"]):
                assert probe["httpGet"]["port"] in ports, name
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), name
            assert "memory" in container["resources"]["limits"], name
            # The serving port is the one the process is told to listen on.
            assert arg_value(container["args"], "--port") in ports.values(), name
        for container in containers(deployment, init=True):
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name


def test_gpu_worker_lands_on_a_gpu_node(base: list[dict[str, Any]]) -> None:
    deployments = of_kind(base, "Deployment")
    gpu = deployments["switchboard-worker-gpu"]["spec"]["template"]["spec"]
    assert gpu["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu["tolerations"])
    [container] = gpu["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--device=cuda" in container["args"]
    assert container["image"] == "switchboard-gpu"
    # The CPU worker and the gateway never ask for a GPU.
    for name in ("switchboard-worker-cpu", "switchboard-gateway"):
        for c in containers(deployments[name]):
            assert "nvidia.com/gpu" not in str(c["resources"])
    images = {i["name"] for i in yaml.safe_load((BASE / "kustomization.yaml").read_text())[
        "images"]}
    used = {c["image"] for d in [*deployments.values(), *of_kind(base, "Job").values()]
            for c in containers(d, init=True)}
    assert used <= images


def test_workers_register_with_their_pod_address(base: list[dict[str, Any]]) -> None:
    for name in ("switchboard-worker-gpu", "switchboard-worker-cpu"):
        [container] = containers(of_kind(base, "Deployment")[name])
        assert container["args"][:2] == ["switchboard", "worker"]
        env = {e["name"]: e for e in container["env"]}
        # $(VAR) in args is expanded by the kubelet from the container's env.
        for var in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):
            assert var in env, var
        args = parse_worker_args(container["args"][2:])
        assert args.register_redis == "$(SWITCHBOARD_REDIS_URL)"
        assert args.advertise_url == f"http://$(POD_IP):{args.port}"
        assert args.worker_id == "$(POD_NAME)"
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert "SWITCHBOARD_WORKER_SECRET" in env
        assert "SWITCHBOARD_DATABASE_URL" not in env and "envFrom" not in container
        # Drained before the stop, within the grace period.
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[:2] == ["switchboard-probe", "drain"]
        wait = float(pre_stop[pre_stop.index("--wait") + 1])
        grace = of_kind(base, "Deployment")[name]["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"]
        assert wait < grace


def test_gateway_and_migrations(base: list[dict[str, Any]], secret: dict[str, Any]) -> None:
    gateway = of_kind(base, "Deployment")["switchboard-gateway"]
    configmaps = of_kind(base, "ConfigMap")
    [container] = containers(gateway)
    assert container["args"] == ["switchboard", "serve", "--host", "0.0.0.0", "--port", "8000"]
    env = configmaps["switchboard-gateway-env"]["data"]
    assert env["SWITCHBOARD_MIGRATE_ON_START"] == "false"
    assert env["SWITCHBOARD_EMBEDDED__MODEL"] == "none"
    # Replicas wait for the migrate Job's schema instead of migrating themselves.
    [init] = gateway["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][:2] == ["switchboard-probe", "schema"]
    job = of_kind(base, "Job")["switchboard-migrate"]
    [migrate] = containers(job)
    assert migrate["args"] == ["switchboard", "migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    for c in (init, migrate):
        [db] = [e for e in c["env"] if e["name"] == "SWITCHBOARD_DATABASE_URL"]
        assert db["valueFrom"]["secretKeyRef"]["key"] in secret["stringData"]
    # The routing file is mounted where SWITCHBOARD_DEPLOYMENTS_FILE points.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    config_volume = next(n for n, v in volumes.items() if "configMap" in v)
    configmap = configmaps[volumes[config_volume]["configMap"]["name"]]
    [filename] = configmap["data"]
    assert f"{mounts[config_volume]}/{filename}" == env["SWITCHBOARD_DEPLOYMENTS_FILE"]
    assert mounts["outbox"] == env["SWITCHBOARD_USAGE_OUTBOX_DIR"]


def test_deployments_config_discovers_workers(base: list[dict[str, Any]],
                                              tmp_path: Path) -> None:
    """Loads with the gateway's own loader; the workers serve the model it routes."""
    text = of_kind(base, "ConfigMap")["switchboard-deployments"]["data"]["deployments.yaml"]
    path = tmp_path / "deployments.yaml"
    path.write_text(text)
    [deployment] = load_routing_file(path).deployments
    assert deployment.provider == "worker" and deployment.discover is True
    for name in ("switchboard-worker-gpu", "switchboard-worker-cpu"):
        [container] = containers(of_kind(base, "Deployment")[name])
        assert parse_worker_args(container["args"][2:]).served_model_name == \
            deployment.upstream_model


def test_settings_are_real(base: list[dict[str, Any]], secret: dict[str, Any]) -> None:
    configmaps = of_kind(base, "ConfigMap")
    names: set[str] = set(secret["stringData"])
    for workload in [*of_kind(base, "Deployment").values(), *of_kind(base, "Job").values()]:
        for container in containers(workload, init=True):
            names |= env_names(container, configmaps, secret)
    names |= set(configmaps["switchboard-gateway-env"]["data"])
    assert unknown_env_names(names) == set()
    values = {k.removeprefix("SWITCHBOARD_").lower(): v
              for k, v in configmaps["switchboard-gateway-env"]["data"].items()}
    Settings(**values)  # types and choices are valid
    # Every secretKeyRef names a key of the Secret.
    for workload in [*of_kind(base, "Deployment").values(), *of_kind(base, "Job").values()]:
        for container in containers(workload, init=True):
            for e in container.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"]
                    assert ref["key"] in secret["stringData"]


def test_secret_example_holds_placeholders_only(secret: dict[str, Any]) -> None:
    assert secret["kind"] == "Secret"
    assert {"SWITCHBOARD_DATABASE_URL", "SWITCHBOARD_REDIS_URL", "SWITCHBOARD_SECRET_KEY",
            "SWITCHBOARD_WORKER_SECRET", "SWITCHBOARD_METRICS_TOKEN"} == set(secret["stringData"])
    for key, value in secret["stringData"].items():
        assert "CHANGE_ME" in value, key
    assert urlsplit(secret["stringData"]["SWITCHBOARD_DATABASE_URL"]).scheme == \
        "postgresql+asyncpg"


def test_hpa_targets_the_gateway(base: list[dict[str, Any]],
                                 everything: list[dict[str, Any]]) -> None:
    deployments = of_kind(everything, "Deployment")
    hpas = of_kind(everything, "HorizontalPodAutoscaler")
    gateway_hpa = of_kind(base, "HorizontalPodAutoscaler")["switchboard-gateway"]
    assert gateway_hpa["apiVersion"] == "autoscaling/v2"
    assert gateway_hpa["spec"]["minReplicas"] >= 2
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu"
               for m in gateway_hpa["spec"]["metrics"])
    for hpa in hpas.values():
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        assert target["name"] in deployments
    assert gateway_hpa["spec"]["scaleTargetRef"]["name"] == "switchboard-gateway"


def test_services_and_budgets_select_the_right_pods(everything: list[dict[str, Any]]) -> None:
    deployments = of_kind(everything, "Deployment")
    services = of_kind(everything, "Service")
    assert services["switchboard-workers"]["spec"]["clusterIP"] == "None"  # headless

    def selected(selector: dict[str, str]) -> set[str]:
        return {n for n, d in deployments.items() if selects(selector, pod_labels(d))}

    assert selected(services["switchboard-gateway"]["spec"]["selector"]) == \
        {"switchboard-gateway"}
    assert selected(services["switchboard-workers"]["spec"]["selector"]) == \
        {"switchboard-worker-gpu", "switchboard-worker-cpu"}
    for service in services.values():
        for port in service["spec"]["ports"]:
            for name in selected(service["spec"]["selector"]):
                names = {p["name"] for c in containers(deployments[name]) for p in c["ports"]}
                assert port["targetPort"] in names
    for name, budget in of_kind(everything, "PodDisruptionBudget").items():
        assert selected(budget["spec"]["selector"]["matchLabels"]), name
    for name, policy in of_kind(everything, "NetworkPolicy").items():
        assert selected(policy["spec"]["podSelector"]["matchLabels"]), name
    for ingress in of_kind(everything, "Ingress").values():
        for rule in ingress["spec"]["rules"]:
            paths = {p["path"] for p in rule["http"]["paths"]}
            assert "/v1" in paths and "/metrics" not in paths
            for p in rule["http"]["paths"]:
                backend = p["backend"]["service"]
                assert backend["name"] == "switchboard-gateway"
                assert backend["port"]["name"] in {
                    q["name"] for q in services["switchboard-gateway"]["spec"]["ports"]}


def test_service_monitors_use_real_ports_and_tokens(everything: list[dict[str, Any]],
                                                    secret: dict[str, Any]) -> None:
    services = of_kind(everything, "Service")
    monitors = of_kind(everything, "ServiceMonitor")
    tokens = {}
    for name, monitor in monitors.items():
        [service] = [s for s in services.values()
                     if selects(monitor["spec"]["selector"]["matchLabels"],
                                s["metadata"]["labels"])]
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"
        credentials = endpoint["authorization"]["credentials"]
        assert credentials["key"] in secret["stringData"]
        tokens[name] = credentials["key"]
    assert tokens == {"switchboard-gateway": "SWITCHBOARD_METRICS_TOKEN",
                      "switchboard-workers": "SWITCHBOARD_WORKER_SECRET"}
