"""A gateway in front of SmolLM2 workers that register in Redis, all on loopback.

Measures what the fleet features cost and how fast they act:
- hop: sequential short completions, straight to a worker vs through the gateway;
- skew: with one worker loaded by another client, where the gateway sends new requests;
- failover: a non-streamed request whose worker is killed mid-generation, and the request
  right after (both must succeed, on the other worker);
- join: from a new worker's first heartbeat to the gateway routing to it.

    .venv/bin/python bench/worker_fleet.py [--requests 30]

Needs Redis on 127.0.0.1:6379. Results go to bench/results/worker_fleet.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common.gateway_procs import (  # noqa: E402
    ServerProcess,
    free_port,
    gateway_cli,
    gateway_env,
    http_request,
    python,
)
from bench.common.machine import cpu_model  # noqa: E402

REDIS = "redis://127.0.0.1:6379/0"
SECRET = "bench-fleet-secret"
MESSAGES = [{"role": "user", "content": "Name one colour."}]


def start_worker(tmp: Path, served: str, worker_id: str, kv_cache_mib: int = 256,
                 extra: Sequence[str] = ()) -> ServerProcess:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SWITCHBOARD_WORKER_SECRET": SECRET,
           "SWITCHBOARD_WORKER_HEARTBEAT_TTL_S": "3", "SWITCHBOARD_LOG_LEVEL": "warning"}
    argv = [python(), "-m", "gateway.cli", "worker", "--served-model-name", served,
            "--port", str(port), "--worker-id", worker_id, "--register-redis", REDIS,
            "--kv-cache-memory", str(kv_cache_mib << 20), *extra]
    worker = ServerProcess(worker_id, argv, port, tmp / f"{worker_id}.log", env=env, cwd=ROOT)
    worker.start()
    worker.wait_ready("/health/ready", 180)
    return worker


def start_gateway(tmp: Path, served: str, **pool: Any) -> tuple[ServerProcess, str]:
    """A gateway whose one deployment is the worker pool (`pool`: more of its settings)."""
    (tmp / "deployments.yaml").write_text(json.dumps({"deployments": [{
        "name": "pool", "model_name": "smollm2", "provider": "worker", "discover": True,
        "upstream_model": served, "input_price_per_1m": 0.05, "output_price_per_1m": 0.1,
        **pool}]}))
    env = gateway_env(tmp) | {"SWITCHBOARD_REDIS_URL": REDIS, "SWITCHBOARD_WORKER_SECRET": SECRET,
                              "SWITCHBOARD_WORKER_STATS_INTERVAL_S": "0.5"}
    gateway_cli(["migrate"], env)
    gateway_cli(["plans", "create", "--name", "bench", "--rpm", "1000000", "--tpm",
                 "1000000000", "--budget-usd", "100000"], env)
    tenant = gateway_cli(["tenants", "create", "--name", "bench", "--plan", "bench"], env)
    key = str(gateway_cli(["keys", "create", "--tenant", str(tenant["id"])], env)["key"])
    port = free_port()
    gateway = ServerProcess("gateway", [python(), "-m", "gateway.cli", "serve", "--port",
                                        str(port)], port, tmp / "gateway.log", env=env, cwd=ROOT)
    gateway.start()
    gateway.wait_ready("/health/ready", 120)
    return gateway, key


def complete(url: str, key: str | None, model: str, max_tokens: int = 8
             ) -> tuple[float, int, dict[str, str]]:
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    started = time.perf_counter()
    # The response cache would answer repeats of this deterministic request: measure the path.
    status, headers, _ = http_request("POST", f"{url}/v1/chat/completions", body, {
        "Content-Type": "application/json", "Authorization": f"Bearer {key}",
        "x-switchboard-cache": "off"}, timeout_s=300)
    return (time.perf_counter() - started) * 1000, status, headers


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def deployments(gateway: ServerProcess) -> set[str]:
    _, _, body = http_request("GET", f"{gateway.url}/health")
    return set(json.loads(body or b"{}").get("deployments", {}))


def hop(gateway: ServerProcess, key: str, worker: ServerProcess, served: str,
        n: int) -> dict[str, Any]:
    direct, through = [], []
    for _ in range(n):  # interleaved, so drift in machine load hits both alike
        ms, status, _ = complete(worker.url, SECRET, served)
        assert status == 200
        direct.append(ms)
        ms, status, _ = complete(gateway.url, key, "smollm2")
        assert status == 200
        through.append(ms)
    return {"requests": n, "direct_p50_ms": round(statistics.median(direct), 1),
            "gateway_p50_ms": round(statistics.median(through), 1),
            "direct_p99_ms": round(percentile(direct, 0.99), 1),
            "gateway_p99_ms": round(percentile(through, 0.99), 1),
            "added_p50_ms": round(statistics.median(through) - statistics.median(direct), 1)}


def skew(gateway: ServerProcess, key: str, busy: ServerProcess, served: str) -> dict[str, Any]:
    """Another client keeps `busy` loaded; count where the gateway sends 10 requests."""
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            complete(busy.url, SECRET, served, max_tokens=64)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the gateway has polled the load by now
    chosen = []
    for _ in range(10):
        _, status, headers = complete(gateway.url, key, "smollm2")
        assert status == 200
        chosen.append(headers.get("x-switchboard-deployment", ""))
    stop.set()
    for t in threads:
        t.join(120)
    loaded = f"pool@{busy.name}"
    return {"requests": 10, "to_loaded_worker": chosen.count(loaded),
            "to_idle_worker": len(chosen) - chosen.count(loaded)}


def failover(gateway: ServerProcess, key: str, workers: list[ServerProcess],
             served: str) -> dict[str, Any]:
    baseline, status, _ = complete(gateway.url, key, "smollm2", max_tokens=128)
    assert status == 200
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["ms"], result["status"], result["headers"] = complete(
            gateway.url, key, "smollm2", max_tokens=128)
        result["done_at"] = time.perf_counter()

    thread = threading.Thread(target=long_request)
    thread.start()
    victim = None
    seen: list[Any] = []
    for _ in range(400):
        for w in workers:
            status, _, body = http_request("GET", f"{w.url}/stats",
                                           headers={"Authorization": f"Bearer {SECRET}"})
            seen = [w.name, status, body[:300]]
            if status == 200 and json.loads(body).get("in_flight"):
                victim = w
                break
        if victim is not None or not thread.is_alive():
            break
        time.sleep(0.01)
    assert victim is not None, f"no worker picked the request up: {seen} {result}"
    time.sleep(0.3)
    killed_at = time.perf_counter()
    os.killpg(victim.proc.pid, 9)  # type: ignore[union-attr]
    thread.join(300)
    after_ms, after_status, after_headers = complete(gateway.url, key, "smollm2")
    return {"baseline_128_tokens_ms": round(baseline, 1),
            "killed_request_status": result["status"],
            "killed_request_ms": round(result["ms"], 1),
            "killed_request_attempts": result["headers"].get("x-switchboard-attempts"),
            "kill_to_answer_ms": round((result["done_at"] - killed_at) * 1000, 1),
            "next_request_status": after_status, "next_request_ms": round(after_ms, 1),
            "next_request_attempts": after_headers.get("x-switchboard-attempts"),
            "victim": victim.name}


def join(gateway: ServerProcess, tmp: Path, served: str) -> dict[str, Any]:
    worker_id = f"{served}-c"
    worker = start_worker(tmp, served, worker_id)
    ready_at = time.perf_counter()
    for _ in range(200):
        if f"pool@{worker_id}" in deployments(gateway):
            return {"ready_to_routable_ms": round((time.perf_counter() - ready_at) * 1000, 1),
                    "worker": worker}
        time.sleep(0.02)
    raise RuntimeError("the new worker never became a deployment")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                        "worker_fleet.json")
    args = parser.parse_args(argv)
    served = f"smollm2-bench-{uuid.uuid4().hex[:6]}"
    procs: list[ServerProcess] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            a = start_worker(tmp, served, f"{served}-a")
            b = start_worker(tmp, served, f"{served}-b")
            procs += [a, b]
            gateway, key = start_gateway(tmp, served)
            procs.append(gateway)
            results: dict[str, Any] = {"machine": cpu_model(), "cpus": os.cpu_count()}
            results["hop"] = hop(gateway, key, a, served, args.requests)
            results["skew"] = skew(gateway, key, a, served)
            results["join"] = join(gateway, tmp, served)
            procs.append(results["join"].pop("worker"))
            results["failover"] = failover(gateway, key, [a, b, procs[-1]], served)
        finally:
            for p in procs:
                p.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
