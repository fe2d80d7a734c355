"""A gateway in front of two live `switchboard worker` processes (tiny random Llama) that
register themselves in Redis: routing by load and adapter affinity, drain, a worker killed
mid-request (retried when whole, an error event when streamed, metered either way), and
metrics scraped from both sides."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from gateway.app import create_app
from gateway.deployments.base import engine_adapter_name
from gateway.routing.prefix import cached_tokens, load_tokenizer
from gateway.surfaces import CHAT
from tenancy.db import make_engine, make_sessionmaker
from tenancy.models import UsageRecord
from tests.dbutil import migrated_database
from tests.gateway.support import (
    REPO,
    admin_key,
    bearer,
    free_port,
    in_process,
    ok,
    seed_tenant,
    settings,
    wait_http,
)
from tests.workers.lora.helpers import make_peft_adapter
from workers.client import prompt_token_ids

SECRET = "fleet-secret-for-tests"
REDIS = "redis://127.0.0.1:6379/0"
LONG = 900  # tokens: a few seconds of tiny-Llama decoding, time to act mid-request


@dataclass
class Worker:
    worker_id: str
    url: str
    proc: subprocess.Popen[bytes]

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=bearer(SECRET), timeout=5)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def start_worker(model_path: Path, served: str, worker_id: str, *, register: bool = True,
                 env: dict[str, str] | None = None, stdout: Path | None = None,
                 **flags: str) -> Worker:
    port = free_port()
    args = [sys.executable, "-m", "gateway.cli", "worker", "--model", str(model_path),
            "--served-model-name", served, "--port", str(port), "--worker-id", worker_id,
            "--kv-cache-memory", str(16 << 20)]
    if register:
        args += ["--register-redis", REDIS]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}", value]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SWITCHBOARD_WORKER_SECRET": SECRET,
           "SWITCHBOARD_WORKER_HEARTBEAT_TTL_S": "1.5", "SWITCHBOARD_LOG_LEVEL": "warning",
           "PYTHONUNBUFFERED": "1", **(env or {})}
    out = subprocess.DEVNULL if stdout is None else stdout.open("wb")
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health/ready", timeout_s=90, proc=proc)
    except BaseException:
        proc.kill()
        raise
    return Worker(worker_id, url, proc)


def stop(workers: list[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(20)
        except subprocess.TimeoutExpired:
            w.proc.kill()


@dataclass
class Fleet:
    client: httpx.AsyncClient
    app: object
    tenant: object
    admin: dict[str, str]
    workers: dict[str, Worker]
    served: str
    db_url: str

    def deployment(self, worker: Worker) -> str:
        return f"pool@{worker.worker_id}"


@pytest.fixture
def served() -> str:
    return f"tiny-{uuid.uuid4().hex[:8]}"  # this test's own workers only, in a shared Redis


@pytest.fixture
def workers(tiny_llama_path, served) -> Iterator[dict[str, Worker]]:
    started: list[Worker] = []
    try:
        # Worker A runs two sequences at a time, so extra requests queue there.
        started.append(start_worker(tiny_llama_path, served, f"{served}-a", max_num_seqs="2"))
        started.append(start_worker(tiny_llama_path, served, f"{served}-b"))
        yield {"a": started[0], "b": started[1]}
    finally:
        stop(started)


@pytest.fixture
async def fleet(tmp_path, workers, served, tiny_llama_path) -> AsyncIterator[Fleet]:
    routing = tmp_path / "routing.yaml"
    routing.write_text(yaml.safe_dump({"deployments": [{
        "name": "pool", "model_name": "tiny", "provider": "worker", "discover": True,
        "upstream_model": served, "input_price_per_1m": "1", "output_price_per_1m": "2",
        "context_window": 1024, "prefix_tokenizer": str(tiny_llama_path)}]}))
    async with migrated_database("sqlite", tmp_path) as db_url:
        cfg = settings(db_url, tmp_path, deployments_file=routing, redis_url=REDIS,
                       worker_secret=SECRET, worker_stats_interval_s=0.2,
                       adapter_dir=tmp_path / "adapters", route_max_attempts=3)
        tenant = await seed_tenant(db_url, tmp_path, name="fleet-tenant")
        admin = bearer(await admin_key(db_url, tmp_path))
        app = create_app(cfg)
        async with in_process(app) as client:
            yield Fleet(client, app, tenant, admin, workers, served, db_url)


def chat_body(max_tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hello there"}], **extra}


async def chat(fleet: Fleet, model: str = "tiny", **extra: object) -> httpx.Response:
    return await fleet.client.post("/v1/chat/completions", headers={
        **bearer(fleet.tenant.key), "x-switchboard-cache": "off"},
        json={**chat_body(), "model": model, **extra})


async def until(predicate, *, timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_discovered_workers_serve_and_the_least_loaded_one_is_chosen(fleet):
    a, b = fleet.workers["a"], fleet.workers["b"]
    registry = fleet.app.state.gateway.deployments
    names = {d.name for d in registry.deployments()}
    assert names == {fleet.deployment(a), fleet.deployment(b)}
    served = {(await chat(fleet)).headers["x-switchboard-deployment"] for _ in range(8)}
    assert served <= names and served  # both are candidates when idle

    # Load worker A directly (as another gateway would): 2 run there, 4 wait in its queue.
    async with httpx.AsyncClient(timeout=120) as direct:
        busy = [asyncio.create_task(direct.post(f"{a.url}/v1/completions", headers=bearer(
            SECRET), json={"model": fleet.served, "prompt": "x", "max_tokens": LONG,
                           "ignore_eos": True})) for _ in range(6)]
        pool_a = registry.get(fleet.deployment(a))
        await until(lambda: pool_a.stats()["num_waiting"] >= 3, what="A's queue in /stats")
        chosen = [(await chat(fleet)).headers["x-switchboard-deployment"] for _ in range(6)]
        assert chosen == [fleet.deployment(b)] * 6
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)


async def test_workers_charge_the_fair_share_to_the_gateways_tenant(fleet):
    """The gateway tells each worker whom a request is for (tenant, plan weight and
    priority, never the client's say): the workers' engines charge that tenant's share."""
    for _ in range(3):
        ok(await chat(fleet))
    charged: dict[str, int] = {}
    for worker in fleet.workers.values():
        for tenant, tokens in worker.get("/stats").json()["tenants"].items():
            charged[tenant] = charged.get(tenant, 0) + tokens
    assert set(charged) == {fleet.tenant.tenant_id} and charged[fleet.tenant.tenant_id] > 0
    registry = fleet.app.state.gateway.deployments
    await until(lambda: sum(d.tenant_tokens().get(fleet.tenant.tenant_id, 0)
                            for d in registry.deployments()) == charged[fleet.tenant.tenant_id],
                what="the polled /stats")


SYSTEM = "You answer questions about the history of tea, briefly and with care. " * 12


async def test_follow_up_turns_go_to_the_worker_holding_the_conversation(
        fleet, tmp_path, tiny_llama_path):
    """Turn 1 lands on A (B drained meanwhile); with both idle, every follow-up goes to A,
    which holds the conversation's prefix; another tenant's identical conversation has no
    affinity anywhere (its salt differs); and once A is overloaded the next turn goes to B."""
    a, b = fleet.workers["a"], fleet.workers["b"]
    name_a, name_b = fleet.deployment(a), fleet.deployment(b)
    registry = fleet.app.state.gateway.deployments
    pool = [registry.get(name_a), registry.get(name_b)]
    ok(await fleet.client.post(f"/admin/deployments/{name_b}/drain", headers=fleet.admin))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where?"}]
    r = await fleet.client.post("/v1/chat/completions", headers=bearer(fleet.tenant.key),
                                json={**chat_body(6), "messages": messages})
    assert r.headers["x-switchboard-deployment"] == name_a
    ok(await fleet.client.post(f"/admin/deployments/{name_b}/drain", headers=fleet.admin,
                               json={"drain": False}))

    async def affinity(tenant_id: str, request: dict[str, object]) -> dict[str, int]:
        parsed = CHAT.parse(json.dumps(request).encode())
        return (await cached_tokens(pool, parsed, tenant_id=tenant_id)).cached

    body: dict[str, object] = {**chat_body(6), "messages": messages}
    for turn in range(3):
        ids = prompt_token_ids(body, chat=True, tokenizer=load_tokenizer(str(tiny_llama_path)))
        held = (len(ids) - 1) // 16 * 16  # the last turn's full blocks, now cached on A
        deadline = time.monotonic() + 15  # until A's polled /stats shows them
        while (await affinity(fleet.tenant.tenant_id, body)).get(name_a) != held:
            assert time.monotonic() < deadline, "A's summary never showed the conversation"
            await asyncio.sleep(0.1)
        assert held >= 128 and (await affinity(fleet.tenant.tenant_id, body))[name_b] == 0
        messages = [*messages, {"role": "assistant", "content": r.json()["choices"][0][
            "message"]["content"]}, {"role": "user", "content": f"And then, part {turn}?"}]
        body = {**chat_body(6), "messages": messages}
        assert pool[1].stats()["accepting"] == 1.0
        r = await fleet.client.post("/v1/chat/completions", headers={
            **bearer(fleet.tenant.key), "x-switchboard-cache": "off"}, json=body)
        assert r.headers["x-switchboard-deployment"] == name_a, turn

    await until(lambda: pool[0].stats().get("prefix_cache_hit_rate", 0) > 0.5,
                what="A's prefix-cache hits (what the console's workers page shows)")
    other = await seed_tenant(fleet.db_url, tmp_path, name="other-tenant")
    # Its salt names other blocks: at most one may pass A's Bloom filter as a false positive
    # (about 1% each; two in a row, 1e-4), never the conversation's chain of `held` tokens.
    stranger = await affinity(other.tenant_id, body)
    assert set(stranger) == {name_a, name_b} and max(stranger.values()) <= 16 < held

    async with httpx.AsyncClient(timeout=120) as direct:  # A: 2 run, 4 wait
        busy = [asyncio.create_task(direct.post(f"{a.url}/v1/completions", headers=bearer(
            SECRET), json={"model": fleet.served, "prompt": "x", "max_tokens": LONG,
                           "ignore_eos": True})) for _ in range(6)]
        await until(lambda: pool[0].stats()["num_waiting"] >= 4, what="A's queue in /stats")
        r = await fleet.client.post("/v1/chat/completions", headers={
            **bearer(fleet.tenant.key), "x-switchboard-cache": "off"}, json=body)
        assert r.headers["x-switchboard-deployment"] == name_b
        for task in busy:
            task.cancel()
        await asyncio.gather(*busy, return_exceptions=True)


async def test_adapter_requests_go_where_the_adapter_is(fleet, tiny_llama_path, tmp_path):
    a, b = fleet.workers["a"], fleet.workers["b"]
    adapter = make_peft_adapter(tiny_llama_path, tmp_path / "ft", seed=4, r=4)
    ok(await fleet.client.post(f"/admin/tenants/{fleet.tenant.tenant_id}/adapters",
                               headers=fleet.admin, json={"name": "ft", "base_model": "tiny",
                                                          "path": str(adapter)}), 201)
    name = engine_adapter_name(fleet.tenant.tenant_id, "ft")
    # Registration loaded it on both workers; take it off A.
    assert name in a.get("/stats").json()["adapters"]
    registry = fleet.app.state.gateway.deployments
    await registry.get(fleet.deployment(a)).unload_adapter(name)
    assert name not in a.get("/stats").json()["adapters"]
    await until(lambda: registry.get(fleet.deployment(a)).adapter_residency(name) is None,
                what="A's stats to drop the adapter")
    replies = [await chat(fleet, model="tiny:ft") for _ in range(5)]
    assert [r.headers["x-switchboard-deployment"] for r in replies] == [fleet.deployment(b)] * 5
    assert all(r.json()["model"] == "tiny:ft" for r in replies)
    # Another tenant cannot name it, through the gateway or by the engine name.
    other = await seed_tenant(fleet.db_url, tmp_path, name="other-tenant")
    r = await fleet.client.post("/v1/chat/completions", headers=bearer(other.key),
                                json={**chat_body(), "model": "tiny:ft"})
    assert r.status_code == 404
    r = await fleet.client.post("/v1/chat/completions", headers=bearer(other.key),
                                json={**chat_body(), "model": name})
    assert r.status_code == 404


async def test_a_drained_worker_gets_nothing_new_until_resumed(fleet):
    a, b = fleet.workers["a"], fleet.workers["b"]
    name_a = fleet.deployment(a)
    body = ok(await fleet.client.post(f"/admin/deployments/{name_a}/drain",
                                      headers=fleet.admin))
    assert body["load"]["accepting"] == 0.0
    assert httpx.get(f"{a.url}/health/ready").status_code == 503
    chosen = {(await chat(fleet)).headers["x-switchboard-deployment"] for _ in range(6)}
    assert chosen == {fleet.deployment(b)}
    ok(await fleet.client.post(f"/admin/deployments/{name_a}/drain", headers=fleet.admin,
                               json={"drain": False}))
    assert httpx.get(f"{a.url}/health/ready").status_code == 200
    r = await fleet.client.post(f"/admin/deployments/{fleet.deployment(b)}/drain",
                                headers=fleet.admin, json={"drain": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def worker_serving(fleet: Fleet) -> Worker:
    """The worker that has a request in flight now (polled directly)."""
    for worker in fleet.workers.values():
        if worker.proc.poll() is None and worker.get("/stats").json()["in_flight"] > 0:
            return worker
    raise LookupError


async def in_flight_worker(fleet: Fleet) -> Worker:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            return await asyncio.to_thread(worker_serving, fleet)
        except LookupError:
            await asyncio.sleep(0.05)
    raise AssertionError("no worker picked the request up")


async def usage_of(fleet: Fleet, request_id: str) -> UsageRecord:
    engine = make_engine(fleet.db_url)
    try:
        for _ in range(100):
            async with make_sessionmaker(engine)() as session:
                found = (await session.execute(select(UsageRecord).where(
                    UsageRecord.request_id == request_id))).scalar_one_or_none()
            if found is not None:
                return found
            await asyncio.sleep(0.1)
    finally:
        await engine.dispose()
    raise AssertionError(f"no usage record for {request_id}")


async def test_a_killed_worker_fails_over_whole_requests_and_ends_streams_clearly(fleet):
    # Non-streamed: the worker dies mid-generation; the request is retried on the other one.
    request = asyncio.create_task(chat(fleet, max_tokens=LONG))
    victim = await in_flight_worker(fleet)
    survivor = next(w for w in fleet.workers.values() if w is not victim)
    victim.kill()
    resp = await request
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-switchboard-deployment"] == fleet.deployment(survivor)
    assert resp.headers["x-switchboard-attempts"] == "2"
    assert resp.json()["usage"]["completion_tokens"] == LONG
    record = await usage_of(fleet, resp.headers["x-request-id"])
    assert record.status == "ok" and record.deployment == fleet.deployment(survivor)

    # Streamed: events are already out when the worker dies, so the stream ends with an
    # OpenAI-shaped error event, promptly, and the tokens it got are metered. (The in-process
    # client hands the body over whole, so the kill is timed from the worker's side.)
    stream = asyncio.create_task(fleet.client.post(
        "/v1/chat/completions", headers={**bearer(fleet.tenant.key),
                                         "x-switchboard-cache": "off"},
        json=chat_body(LONG, stream=True)))
    assert await in_flight_worker(fleet) is survivor
    await asyncio.sleep(0.2)  # some tokens are out
    survivor.kill()
    resp = await asyncio.wait_for(stream, 30)
    assert resp.status_code == 200
    assert resp.headers["x-switchboard-deployment"] == fleet.deployment(survivor)
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert len(events) > 2
    assert '"error"' in events[-1] and "upstream" in events[-1]
    assert "[DONE]" not in events
    record = await usage_of(fleet, resp.headers["x-request-id"])
    assert record.status != "ok"
    assert 0 < record.completion_tokens < LONG
    assert record.deployment == fleet.deployment(survivor)


async def test_metrics_on_both_sides_parse_and_count_the_traffic(fleet):
    for _ in range(3):
        assert (await chat(fleet)).status_code == 200
    samples: dict[str, float] = {}
    for worker in fleet.workers.values():
        text = worker.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "switchboard_worker_requests_total" and s.labels == {
                        "kind": "chat", "status": "ok"}:
                    samples[worker.worker_id] = s.value
                if s.name == "switchboard_worker_requests_running":
                    assert s.value >= 0
    assert sum(samples.values()) == 3
    gateway = [s for f in text_string_to_metric_families(
        (await fleet.client.get("/metrics")).text) for s in f.samples]
    assert sum(s.value for s in gateway if s.name == "switchboard_requests_total"
               and s.labels["status"] == "ok") == 3
    # Each worker's polled load is on the gateway's scrape too, one series per deployment.
    accepting = {s.labels["deployment"]: s.value for s in gateway
                 if s.name == "switchboard_engine_accepting"}
    assert accepting == {fleet.deployment(w): 1.0 for w in fleet.workers.values()}


def console_spans(text: str) -> list[dict]:
    """Spans as the console exporter prints them: JSON objects one after another."""
    decoder = json.JSONDecoder()
    spans, at = [], 0
    while (start := text.find("{", at)) != -1:
        try:
            obj, at = decoder.raw_decode(text, start)
        except ValueError:
            at = start + 1
            continue
        if isinstance(obj, dict) and "context" in obj:
            spans.append(obj)
    return spans


async def test_one_trace_spans_gateway_and_a_statically_configured_worker(
        tmp_path, tiny_llama_path):
    """The worker comes from the deployments file (no discovery); its spans, printed by the
    console exporter in its own process, continue the gateway's trace."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from workers.telemetry import make_tracer_provider

    printed = tmp_path / "worker-spans.txt"
    worker = start_worker(tiny_llama_path, "tiny-static", "static", register=False,
                          env={"SWITCHBOARD_OTEL_EXPORTER": "console"}, stdout=printed)
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(service_name="gateway", exporter="none",
                                    span_processors=[SimpleSpanProcessor(exporter)])
    routing = tmp_path / "routing.yaml"
    routing.write_text(yaml.safe_dump({"deployments": [{
        "name": "static", "model_name": "tiny", "provider": "worker",
        "upstream_model": "tiny-static", "base_url": f"{worker.url}/v1"}]}))
    try:
        async with migrated_database("sqlite", tmp_path) as db_url:
            cfg = settings(db_url, tmp_path, deployments_file=routing, worker_secret=SECRET)
            tenant = await seed_tenant(db_url, tmp_path, name="traced")
            async with in_process(create_app(cfg, tracer_provider=provider)) as client:
                r = await client.post("/v1/chat/completions", headers={
                    **bearer(tenant.key), "x-switchboard-cache": "off"}, json=chat_body(6))
                assert r.status_code == 200, r.text
                assert r.headers["x-switchboard-deployment"] == "static"
    finally:
        stop([worker])
    dispatch = next(s for s in exporter.get_finished_spans() if s.name == "dispatch")
    trace_id = f"0x{dispatch.context.trace_id:032x}"
    remote = [s for s in console_spans(printed.read_text())
              if s["context"]["trace_id"] == trace_id]
    server = next(s for s in remote if s["kind"] == "SpanKind.SERVER")
    assert server["parent_id"] == f"0x{dispatch.context.span_id:016x}"
    assert server["resource"]["attributes"]["service.name"] == "switchboard-worker"
    phases = {s["name"]: s for s in remote if s["parent_id"] == server["context"]["span_id"]}
    assert set(phases) == {"queue", "prefill", "decode"}
    assert phases["decode"]["attributes"]["gen_ai.usage.output_tokens"] == 6
    assert phases["queue"]["end_time"] <= phases["prefill"]["start_time"] or \
        phases["queue"]["end_time"] == phases["prefill"]["start_time"]


def make_certificates(folder: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=switchboard-test-ca")
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        (folder / f"{name}.ext").write_text(
            f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {n: folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem",
                                     "client.key")}


async def test_mutual_tls_between_gateway_and_worker(tmp_path, tiny_llama_path):
    certs = make_certificates(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", "--model", str(tiny_llama_path),
         "--served-model-name", "tiny-tls", "--port", str(port), "--kv-cache-memory",
         str(16 << 20), "--ssl-certfile", str(certs["server.pem"]), "--ssl-keyfile",
         str(certs["server.key"]), "--ssl-ca-certs", str(certs["ca.pem"])],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", "SWITCHBOARD_WORKER_SECRET": SECRET,
                       "SWITCHBOARD_LOG_LEVEL": "warning"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"https://127.0.0.1:{port}"
    client_ctx = ssl.create_default_context(cafile=str(certs["ca.pem"]))
    client_ctx.load_cert_chain(str(certs["client.pem"]), str(certs["client.key"]))
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "worker did not start"
            try:
                if httpx.get(f"{url}/health/ready", verify=client_ctx).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        # No client certificate: the handshake itself fails, whatever the secret.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health/live",
                      verify=ssl.create_default_context(cafile=str(certs["ca.pem"])))
        routing = tmp_path / "routing.yaml"
        routing.write_text(yaml.safe_dump({"deployments": [{
            "name": "tls", "model_name": "tiny", "provider": "worker",
            "upstream_model": "tiny-tls", "base_url": f"{url}/v1"}]}))
        async with migrated_database("sqlite", tmp_path) as db_url:
            tenant = await seed_tenant(db_url, tmp_path, name="tls-tenant")
            for with_cert in (True, False):
                extra = dict(worker_tls_ca_file=certs["ca.pem"])
                if with_cert:
                    extra |= dict(worker_tls_cert_file=certs["client.pem"],
                                  worker_tls_key_file=certs["client.key"])
                cfg = settings(db_url, tmp_path, deployments_file=routing,
                               worker_secret=SECRET, **extra)
                async with in_process(create_app(cfg)) as client:
                    r = await client.post("/v1/chat/completions", headers={
                        **bearer(tenant.key), "x-switchboard-cache": "off"},
                        json=chat_body(3))
                if with_cert:
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == 3
                else:
                    assert r.status_code in (502, 503), r.text
    finally:
        stop([Worker("tls", url, proc)])


async def test_a_long_whole_answer_from_a_worker_is_not_cut_by_the_routing_deadline(
        tmp_path, tiny_llama_path):
    """A non-streamed request is asked of the worker as a stream: once it has its first
    event the routing deadline no longer applies, so the answer is whole, not a 504, and the
    worker's breaker never hears of it."""
    worker = start_worker(tiny_llama_path, "tiny-long", "long", register=False)
    routing = tmp_path / "routing.yaml"
    routing.write_text(yaml.safe_dump({"deployments": [{
        "name": "static", "model_name": "tiny", "provider": "worker",
        "upstream_model": "tiny-long", "base_url": f"{worker.url}/v1",
        "context_window": 1024}]}))
    try:
        async with migrated_database("sqlite", tmp_path) as db_url:
            cfg = settings(db_url, tmp_path, deployments_file=routing, worker_secret=SECRET,
                           route_budget_s=0.5, breaker_failure_threshold=1)
            tenant = await seed_tenant(db_url, tmp_path, name="patient")
            app = create_app(cfg)
            async with in_process(app) as client:
                started = time.monotonic()
                r = await client.post("/v1/chat/completions", headers={
                    **bearer(tenant.key), "x-switchboard-cache": "off"},
                    json=chat_body(LONG, temperature=0))
                elapsed = time.monotonic() - started
                health = app.state.gateway.deployments.health("static")
                assert r.status_code == 200, r.text
                body = r.json()
                assert elapsed > 0.5  # longer than the deadline that used to cut it
                assert body["usage"]["completion_tokens"] == LONG
                assert body["choices"][0]["finish_reason"] == "length"
                assert body["choices"][0]["message"]["content"]
                assert (health.failures, health.breaker.snapshot().state) == (0, "closed")
                stream = await client.post("/v1/chat/completions", headers={
                    **bearer(tenant.key), "x-switchboard-cache": "off"},
                    json=chat_body(LONG, temperature=0, stream=True))
                text = "".join(
                    json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    for line in stream.text.splitlines()
                    if line.startswith("data: {") and json.loads(line[6:])["choices"])
                assert text == body["choices"][0]["message"]["content"]  # greedy: the same
    finally:
        stop([worker])
