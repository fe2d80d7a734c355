"""No cluster here: check that the Kubernetes manifests in deploy/k8s parse, match the
Kubernetes API's schemas (bundled, offline) and fit together (probes, resources, GPU
scheduling, HPA and Service targets, secrets, settings, the standby GPU worker that takes no
traffic until promoted)."""

from __future__ import annotations

import copy
import functools
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest
from referencing import Registry, Resource

from gateway.deployments.config import load_routing_file
from gateway.settings import Settings
from tests.deploy.support import REPO, parse_worker_args, unknown_env_names
from workers.server.metrics import ENGINE_FIGURES, VLLM_FIGURES, EngineShape, WorkerMetrics

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


def label_selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) as the API server evaluates it."""
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not ok:
            return False
    return True


def test_label_selector_matches_like_the_api_server() -> None:
    selector = {"matchLabels": {"a": "1"},
                "matchExpressions": [{"key": "b", "operator": "In", "values": ["x", "y"]},
                                     {"key": "c", "operator": "DoesNotExist"}]}
    assert label_selector_matches(selector, {"a": "1", "b": "y"})
    assert not label_selector_matches(selector, {"a": "1", "b": "z"})
    assert not label_selector_matches(selector, {"a": "1"})
    assert not label_selector_matches(selector, {"a": "1", "b": "x", "c": ""})
    assert not label_selector_matches(selector, {"a": "2", "b": "x"})


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
                                "switchboard-worker-cpu", "switchboard-worker-gpu-standby"}
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
    [deployment] = [d for d in load_routing_file(path).deployments if d.discover]
    assert deployment.provider == "worker"
    for name in ("switchboard-worker-gpu", "switchboard-worker-cpu",
                 "switchboard-worker-gpu-standby"):
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
    # Workers, the standby included, take traffic only from the gateways and Prometheus.
    [policy] = of_kind(everything, "NetworkPolicy").values()
    fenced = {n for n, d in deployments.items()
              if label_selector_matches(policy["spec"]["podSelector"], pod_labels(d))}
    assert fenced == {"switchboard-worker-gpu", "switchboard-worker-cpu",
                      "switchboard-worker-gpu-standby"}
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
    scraped = {}
    for name, monitor in monitors.items():
        scraped[name] = {n for n, s in services.items()
                         if label_selector_matches(monitor["spec"]["selector"],
                                                   s["metadata"]["labels"])}
        [endpoint] = monitor["spec"]["endpoints"]
        for service in scraped[name]:
            assert endpoint["port"] in {p["name"] for p in services[service]["spec"]["ports"]}
        assert endpoint["path"] == "/metrics"
        credentials = endpoint["authorization"]["credentials"]
        assert credentials["key"] in secret["stringData"]
        tokens[name] = credentials["key"]
    assert tokens == {"switchboard-gateway": "SWITCHBOARD_METRICS_TOKEN",
                      "switchboard-workers": "SWITCHBOARD_WORKER_SECRET"}
    # A promoted standby is scraped through its own Service, so its queue counts in the GPU
    # workers' HPA metric while it serves.
    assert scraped == {"switchboard-gateway": {"switchboard-gateway"},
                       "switchboard-workers": {"switchboard-workers",
                                               "switchboard-worker-gpu-standby"}}


# ---- the Kubernetes API's own schemas ------------------------------------------------------

# The Kubernetes version whose OpenAPI schemas (as JSON schemas, bundled by the
# kubernetes-validate package: no network) every manifest is checked against, strictly: an
# unknown or misspelt field is an error, as `kubectl apply --validate=strict` would make it.
KUBERNETES_VERSION = "1.32.0"

# Documents the bundled schemas do not cover, each with what checks it instead. Every entry
# must occur in the manifests and still lack a schema (both asserted below), so the list cannot
# go stale or hide a kind the validator could check.
NO_SCHEMA: dict[tuple[str, str], str] = {
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"):
        "kustomize's build file, never sent to the API server; its resource list is checked "
        "by test_kustomization_lists_every_manifest",
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        "a Prometheus Operator custom resource; its metadata is checked against ObjectMeta "
        "here, its ports and tokens by test_service_monitors_use_real_ports_and_tokens",
}


def manifest_documents() -> list[tuple[str, dict[str, Any]]]:
    """Every YAML document under deploy/k8s (not only those kustomize lists), with an id."""
    paths = sorted([*BASE.glob("*.yaml"), *OPTIONAL.glob("*.yaml"), SECRET_EXAMPLE])
    found = []
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        found += [(f"{path.relative_to(K8S)}#{i}", doc) for i, doc in enumerate(docs)]
    return found


DOCUMENTS = manifest_documents()


@functools.cache
def object_meta_validator() -> jsonschema.Draft202012Validator:
    """ObjectMeta from the same bundled definitions, strict, for custom resources."""
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / \
        f"v{KUBERNETES_VERSION}-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())
    registry = Resource.from_contents(definitions) @ Registry()
    ref = f"{definitions['$id']}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
    return jsonschema.Draft202012Validator({"$ref": ref}, registry=registry)


def test_the_pinned_schema_version_is_bundled() -> None:
    """kubernetes-validate falls back to the nearest older version it has: pin one it has."""
    assert KUBERNETES_VERSION in kubernetes_validate.utils.all_versions()


@pytest.mark.parametrize("doc", [d for _, d in DOCUMENTS], ids=[i for i, _ in DOCUMENTS])
def test_manifest_matches_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in NO_SCHEMA:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        if "metadata" in doc:
            object_meta_validator().validate(doc["metadata"])
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} at {where}: {exc.message}")


def test_every_schemaless_kind_listed_occurs() -> None:
    assert {(d["apiVersion"], d["kind"]) for _, d in DOCUMENTS} >= set(NO_SCHEMA)


def _deployment() -> dict[str, Any]:
    doc = yaml.safe_load((BASE / "worker-gpu.yaml").read_text())
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # the unbroken one
    return doc


def _set(doc: dict[str, Any], path: tuple[str | int, ...], value: object) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


CONTAINER = ("spec", "template", "spec", "containers", 0)


@pytest.mark.parametrize(("path", "value", "complaint"), [
    (("spec", "replicas"), "two", "is not of type 'integer'"),
    (("spec", "replica"), 2, "'replica' was unexpected"),  # a misspelt field
    ((*CONTAINER, "readinessProbe", "httpGet", "paht"), "/health/ready",
     "'paht' was unexpected"),
    ((*CONTAINER, "ports", 0, "containerPort"), "8001", "is not of type 'integer'"),
    (("spec", "template", "metadata", "labels", "switchboard.dev/promoted"), True,
     "is not of type 'string'"),  # an unquoted "true"
], ids=["replicas-a-string", "unknown-field", "unknown-nested-field", "port-a-string",
        "label-a-boolean"])
def test_a_broken_manifest_fails_schema_validation(path: tuple[str | int, ...], value: object,
                                            complaint: str) -> None:
    """The check can fail: each mistake is one the API server would refuse."""
    doc = _deployment()
    _set(doc, path, value)
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert complaint in caught.value.message


def test_a_custom_resource_with_bad_metadata_fails_schema() -> None:
    with pytest.raises(jsonschema.ValidationError):
        object_meta_validator().validate({"name": "switchboard", "lables": {"a": "b"}})
    with pytest.raises(jsonschema.ValidationError):
        object_meta_validator().validate({"name": "switchboard", "labels": {"replicas": 2}})


# ---- the pre-warmed standby GPU worker ------------------------------------------------------

SERVING = "switchboard-worker-gpu"
STANDBY = "switchboard-worker-gpu-standby"  # the Deployment and the Service that promotes it
SCALING_DOC = REPO / "docs" / "scaling.md"


def without_registration(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The serving pod spec less what registers it in Redis: the standby's, exactly."""
    spec = copy.deepcopy(pod_spec)
    [container] = spec["containers"]
    container["args"] = [a for a in container["args"] if not a.startswith("--register-redis")]
    container["env"] = [e for e in container["env"] if e["name"] != "SWITCHBOARD_REDIS_URL"]
    return spec


def promotion_label(everything: list[dict[str, Any]]) -> tuple[str, str]:
    """The label a standby pod gets to join its Service: the one its selector adds."""
    labels = pod_labels(of_kind(everything, "Deployment")[STANDBY])
    selector = of_kind(everything, "Service")[STANDBY]["spec"]["selector"]
    [(key, value)] = [(k, v) for k, v in selector.items() if labels.get(k) != v]
    return key, value


def shell_commands(text: str) -> list[str]:
    """Lines of `text` with backslash continuations joined and comment marks dropped."""
    lines = [re.sub(r"^\s*#?\s*", "", line) for line in text.splitlines()]
    return re.sub(r"\\\n", " ", "\n".join(lines)).splitlines()


def kubectl_selector(command: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in command.split(" -l ", 1)[1].split()[0].split(","))


def test_standby_runs_the_serving_pod_less_its_registration(base: list[dict[str, Any]]) -> None:
    deployments = of_kind(base, "Deployment")
    serving = deployments[SERVING]["spec"]["template"]["spec"]
    standby = deployments[STANDBY]["spec"]["template"]["spec"]
    [serving_container], [standby_container] = serving["containers"], standby["containers"]
    assert standby_container["image"] == serving_container["image"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert standby_container[probe] == serving_container[probe], probe
    # Same model, engine flags, GPU, node placement, drain and volumes: nothing else differs.
    assert standby == without_registration(serving)
    assert deployments[STANDBY]["spec"]["replicas"] == 1
    # What differs is what matters: the serving pods register in Redis, the standby cannot.
    assert parse_worker_args(serving_container["args"][2:]).register_redis
    assert parse_worker_args(standby_container["args"][2:]).register_redis is None
    assert not any("REDIS" in e["name"] for e in standby_container["env"])
    assert "envFrom" not in standby_container


def test_standby_takes_no_traffic_until_promoted(everything: list[dict[str, Any]]) -> None:
    deployments = of_kind(everything, "Deployment")
    services = of_kind(everything, "Service")
    key, value = promotion_label(everything)
    waiting = pod_labels(deployments[STANDBY])
    promoted = {**waiting, key: value}
    # A promoted pod stays the standby Deployment's (its selector ignores the label) ...
    assert label_selector_matches(deployments[STANDBY]["spec"]["selector"], promoted)
    assert key not in deployments[STANDBY]["spec"]["selector"]["matchLabels"]
    # ... and neither pod is the serving Deployment's (nor so in its HPA's average), in the
    # headless workers Service or under the workers' PDB.
    for labels in (waiting, promoted):
        assert not label_selector_matches(deployments[SERVING]["spec"]["selector"], labels)
        assert not selects(services["switchboard-workers"]["spec"]["selector"], labels)
        for budget in of_kind(everything, "PodDisruptionBudget").values():
            assert not label_selector_matches(budget["spec"]["selector"], labels)
    # The standby's Service has an endpoint only once a standby pod is promoted, and never
    # another Deployment's pod.
    service = services[STANDBY]["spec"]
    assert service.get("clusterIP") != "None"  # a stable address for the gateways' DNS cache
    assert not selects(service["selector"], waiting)
    assert selects(service["selector"], promoted)
    for name, deployment in deployments.items():
        if name != STANDBY:
            assert not selects(service["selector"], {**pod_labels(deployment), key: value})


def test_gateways_reach_the_standby_only_through_its_service(everything: list[dict[str, Any]],
                                                             tmp_path: Path) -> None:
    """The routing file's one static entry is a worker entry (polled: while the Service
    refuses, the gateways send nothing) at the standby Service, priced as the pool."""
    text = of_kind(everything, "ConfigMap")["switchboard-deployments"]["data"]["deployments.yaml"]
    path = tmp_path / "deployments.yaml"
    path.write_text(text)
    routing = load_routing_file(path).deployments
    [pool] = [d for d in routing if d.discover]
    [standby] = [d for d in routing if d.base_url]
    assert standby.provider == "worker" and not standby.discover
    url = urlsplit(standby.base_url or "")
    [port] = of_kind(everything, "Service")[STANDBY]["spec"]["ports"]
    assert (url.scheme, url.hostname, url.port, url.path) == ("http", STANDBY, port["port"], "/v1")
    [container] = containers(of_kind(everything, "Deployment")[STANDBY])
    listening = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert listening[port["targetPort"]] == arg_value(container["args"], "--port")
    assert parse_worker_args(container["args"][2:]).served_model_name == standby.upstream_model
    same = {"name", "discover", "base_url"}
    assert standby.model_dump(exclude=same) == pool.model_dump(exclude=same)


@pytest.mark.parametrize("source", [BASE / "worker-gpu-standby.yaml", SCALING_DOC],
                         ids=["manifest", "docs"])
def test_the_documented_promotion_promotes_the_standby_only(
        source: Path, everything: list[dict[str, Any]]) -> None:
    deployments = of_kind(everything, "Deployment")
    key, value = promotion_label(everything)
    promote = [c for c in shell_commands(source.read_text())
               if c.startswith("kubectl ") and " label pod " in c]
    assert promote, f"no promotion command in {source.name}"
    for command in promote:
        assert f" {key}={value} " in f"{command} " and "--overwrite" in command
        chosen = {n for n, d in deployments.items() if selects(kubectl_selector(command),
                                                               pod_labels(d))}
        assert chosen == {STANDBY}, command


def test_the_documented_demotion_deletes_only_a_promoted_standby(
        everything: list[dict[str, Any]]) -> None:
    key, value = promotion_label(everything)
    [demote] = [c for c in shell_commands(SCALING_DOC.read_text())
                if c.startswith("kubectl ") and " delete pod " in c]
    selector = kubectl_selector(demote)
    standby = pod_labels(of_kind(everything, "Deployment")[STANDBY])
    assert selects(selector, {**standby, key: value})
    assert not selects(selector, standby)  # never the standby still warming or waiting


def test_worker_hpa_scales_only_the_serving_deployment(everything: list[dict[str, Any]]) -> None:
    hpas = of_kind(everything, "HorizontalPodAutoscaler")
    assert STANDBY not in {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()}
    hpa = hpas["switchboard-worker-gpu"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == SERVING
    # The queue of every GPU worker, a promoted standby's included, over the serving pods:
    # an External metric, which the HPA divides by its target, not a per-pod average.
    [metric] = hpa["metrics"]
    assert metric["type"] == "External"
    text = (OPTIONAL / "worker-hpa.yaml").read_text()
    assert f'as: "{metric["external"]["metric"]["name"]}"' in text
    [series] = re.findall(r"seriesQuery: '(\w+)\{", text)
    assert series in exported_metric_names()
    # The adapter rule's pod filter: pods are named <Deployment>-<hash>-<suffix>.
    [pattern] = re.findall(r'pod=~"([^"]+)"', text)
    for name in of_kind(everything, "Deployment"):
        counted = re.fullmatch(pattern, f"{name}-7c9d5b8f4d-x2kqp") is not None
        assert counted == (name in {SERVING, STANDBY}), name


# ---- the metric names docs/scaling.md promises schedulers ------------------------------------

def exported_metric_names(labels: dict[str, set[str]] | None = None) -> set[str]:
    """Sample names a loaded worker exports on /metrics (and, into `labels`, their labels)."""
    stats = dict.fromkeys([*ENGINE_FIGURES, *VLLM_FIGURES], 1.0)
    metrics = WorkerMetrics(lambda: stats, model_name="m",
                            shape=lambda: EngineShape(16, 64, True, 4), adapters=list)
    names = set()
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            names.add(name)
            if labels is not None:
                labels.setdefault(name, set()).update(re.findall(r'(\w+)="', line))
    return names


def test_scaling_doc_names_metrics_the_workers_export() -> None:
    text = SCALING_DOC.read_text()
    section = text.split("### Behind llm-d", 1)[1].split("\n## ", 1)[0]
    labels: dict[str, set[str]] = {}
    exported = exported_metric_names(labels)
    named = re.findall(r"`((?:vllm:|switchboard_worker_)[a-z_:]+)(?:\{([\w,]+)\})?`", section)
    assert len(named) >= 10
    for name, listed in named:
        assert name in exported, name
        assert set(filter(None, listed.split(","))) <= labels[name], name
    assert "switchboard_worker_requests_waiting" in exported
