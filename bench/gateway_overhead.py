"""Gateway overhead: direct to a mock upstream vs through Switchboard, LiteLLM Proxy and Portkey.

Run from the repository root (one command, everything in one run):

    .venv/bin/python bench/gateway_overhead.py            # standard: ~10 s per measurement
    .venv/bin/python bench/gateway_overhead.py --quick    # ~3 s per measurement

What it does:

1. Starts the instant mock upstream (``bench/common/mock_upstream.py``) on a loopback port.
2. For each system, in turn (only one system under test runs at a time):
   - ``direct``: the mock itself;
   - ``gateway``: ``python -m gateway.cli serve`` on a fresh SQLite database, one deployment
     ``mock-model`` on the mock, a plan with limits far above the load, a tenant and a tenant
     key (so auth, rate limits, budget reservation and usage metering all run), served by
     uvicorn with the connection limits, or by granian with ``--server granian``;
   - ``litellm``: LiteLLM Proxy 1.106.0 from its own venv (``bench/common/litellm_peer.py`` says
     what its DB-less config has on), created on first use;
   - ``portkey``: Portkey's open-source gateway 1.15.2 on Node, npm-installed into
     ``bench/.portkey`` on first use (``bench/common/portkey_peer.py``: the upstream is named per
     request in ``x-portkey-*`` headers and the client sends the upstream key; it has no keys,
     limits or metering of its own).
   It checks one plain and one streamed request (and, through a proxy, that the mock saw the
   server-side upstream key), then measures concurrency 1, 32 and 128, non-streamed and
   streamed (``stream_options.include_usage``).
3. Each measurement is one run of ``bench/common/gateway_loadgen.py`` in its own process: a closed
   loop of keep-alive connections, a warmup, then N requests or T seconds, whichever first.
   Latency is time to last byte (streams included); time to first byte is kept too.
4. Prints a table last and writes JSON to ``bench/results/gateway_overhead-cpu.json``
   with the date, machine and command; ``--quick`` or any other non-standard run writes
   ``gateway_overhead-cpu-smoke.json`` instead, which git ignores.

"Added" latency is the system's percentile minus the direct run's at the same concurrency and
mode. The gateway's own ``x-gateway-overhead-ms`` header (LiteLLM's
``x-litellm-overhead-duration-ms``) is summarised as "self-reported". With two or more CPUs the
processes are pinned (``taskset``): load generator and mock on CPU 0, the system under test on
the rest (``--no-pin`` turns that off). The CPU time of the load generator, the mock and the
system under test is measured for every run, so the table shows whether the client or the mock
starved anything.

If the gateway (or a peer) cannot be started, the others are still measured and the JSON and
the table say why that system is missing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common import litellm_peer, portkey_peer  # noqa: E402
from bench.common.gateway_procs import (  # noqa: E402
    Pinning,
    ServerProcess,
    free_port,
    gateway_cli,
    gateway_env,
    http_request,
    post_json,
    python,
)
from bench.common.machine import cpu_family_model, cpu_model, simd_flags  # noqa: E402

MODEL = "mock-model"
UPSTREAM_KEY = litellm_peer.UPSTREAM_KEY
GATEWAY_HEADER = "x-gateway-overhead-ms"
SYSTEMS = ("direct", "gateway", "litellm", "portkey")
CONCURRENCIES = (1, 32, 128)
TARGET_ADDED_P50_MS = 2.0
TARGET_RPS_RATIO = 3.0
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in one short sentence."}]
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Settings:
    """How long each measurement runs."""

    requests: int
    duration_s: float
    warmup_requests: int
    warmup_s: float
    grace_s: float = 30.0


STANDARD = Settings(requests=20_000, duration_s=10.0, warmup_requests=2_000, warmup_s=2.0)
QUICK = Settings(requests=5_000, duration_s=3.0, warmup_requests=300, warmup_s=1.0)


@dataclass
class Target:
    """A system under test: where to send requests and with which key."""

    name: str
    base_url: str
    api_key: str
    self_header: str | None = None
    server: ServerProcess | None = None
    info: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] | None = None  # sent instead of ``Authorization: Bearer api_key``

    def request_headers(self) -> dict[str, str]:
        return dict(self.headers) if self.headers is not None else {
            "Authorization": f"Bearer {self.api_key}"}


def chat_body(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# ----------------------------------------------------------------------------- the systems


def start_mock(tmp: Path, pin: Pinning) -> ServerProcess:
    port = free_port()
    argv = pin.wrap(pin.mock, [python(), "-m", "bench.common.mock_upstream", "--host", "127.0.0.1",
                               "--port", str(port)])
    mock = ServerProcess("mock", argv, port, tmp / "mock.log", cwd=ROOT).start()
    mock.wait_ready("/health", 30)
    return mock


def deployments_yaml(mock_base_url: str) -> str:
    return f"""\
deployments:
  - name: mock
    model_name: {MODEL}
    provider: openai
    upstream_model: {MODEL}
    base_url: {mock_base_url}
    api_key: {UPSTREAM_KEY}
    tier: standard
    input_price_per_1m: 0.15
    output_price_per_1m: 0.60
    context_window: 8192
"""


def start_gateway(tmp: Path, mock: ServerProcess, pin: Pinning, http_server: str = "uvicorn"
                  ) -> Target:
    """Migrate, create plan/tenant/key, serve (under `http_server`); the tenant key's target."""
    gw_tmp = tmp / "gateway"
    gw_tmp.mkdir()
    (gw_tmp / "deployments.yaml").write_text(deployments_yaml(mock.url + "/v1"))
    env = gateway_env(gw_tmp, http_server)
    gateway_cli(["migrate"], env)
    gateway_cli(["plans", "create", "--name", "bench", "--rpm", "10000000", "--tpm",
                 "2000000000", "--max-concurrent", "100000", "--budget-usd", "1000000"], env)
    tenant = gateway_cli(["tenants", "create", "--name", "bench", "--plan", "bench"], env)
    key = gateway_cli(["keys", "create", "--tenant", str(tenant["id"])], env)["key"]
    port = free_port()
    argv = pin.wrap(pin.server, [python(), "-m", "gateway.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(port)])
    server = ServerProcess("gateway", argv, port, gw_tmp / "serve.log", env=env, cwd=ROOT)
    server.start()
    try:
        ready_s = server.wait_ready("/health", 120)
    except Exception:
        server.stop()
        raise
    info = {"setup": "SQLite (aiosqlite), plan rpm=1e7 tpm=2e9 max_concurrent=1e5 "
                     "budget=$1e6, one tenant key", "server": http_server,
            "ready_s": round(ready_s, 2)}
    return Target("gateway", server.url, str(key), GATEWAY_HEADER, server, info)


def start_litellm(tmp: Path, mock: ServerProcess, pin: Pinning) -> Target:
    """Ensure LiteLLM's venv, write its DB-less config, start its CLI with one worker."""
    ll_tmp = tmp / "litellm"
    ll_tmp.mkdir()
    if not litellm_peer.installed_marker().exists():
        print(f"litellm: installing {litellm_peer.LITELLM_REQUIREMENT} into "
              f"{litellm_peer.VENV} (first use, a few minutes)", flush=True)
    litellm = litellm_peer.ensure_venv(log=ll_tmp / "install.log")
    config = ll_tmp / "config.yaml"
    config.write_text(litellm_peer.config_yaml(mock.url + "/v1", MODEL))
    port = free_port()
    argv = pin.wrap(pin.server, litellm_peer.command(litellm, config, "127.0.0.1", port))
    server = ServerProcess("litellm", argv, port, ll_tmp / "serve.log",
                           env=litellm_peer.litellm_env(), cwd=ll_tmp)
    server.start()
    try:
        ready_s = server.wait_ready(litellm_peer.HEALTH_PATH, 180)
    except Exception:
        server.stop()
        raise
    info = {"version": litellm_peer.version(), "ready_s": round(ready_s, 2),
            "command": shlex.join(litellm_peer.command(litellm, config, "127.0.0.1", port)),
            "config": litellm_peer.config_yaml(mock.url + "/v1", MODEL),
            "on": "master-key auth; global_max_parallel_requests=1e5 (in-memory limiter); "
                  "deployment rpm=1e7/tpm=1e10 (tracked in memory); per-request cost from "
                  "model_info prices",
            "off_without_db": "virtual (per-tenant) keys and their per-key RPM/TPM/budgets, "
                              "persisted spend logs"}
    return Target("litellm", server.url, litellm_peer.MASTER_KEY,
                  litellm_peer.SELF_REPORTED_HEADER, server, info)


def start_portkey(tmp: Path, mock: ServerProcess, pin: Pinning) -> Target:
    """Ensure Portkey's npm install, start its Node server; the upstream goes in headers."""
    pk_tmp = tmp / "portkey"
    pk_tmp.mkdir()
    if not portkey_peer.installed_marker().exists():
        print(f"portkey: npm-installing {portkey_peer.PACKAGE}@{portkey_peer.PORTKEY_VERSION} "
              f"into {portkey_peer.DIR} (first use)", flush=True)
    entry = portkey_peer.ensure_installed(log=pk_tmp / "install.log")
    port = free_port()
    argv = pin.wrap(pin.server, portkey_peer.command(entry, port))
    server = ServerProcess("portkey", argv, port, pk_tmp / "serve.log", cwd=pk_tmp)
    server.start()
    try:
        ready_s = server.wait_ready(portkey_peer.HEALTH_PATH, 120)
    except Exception:
        server.stop()
        raise
    info = {"versions": portkey_peer.versions(), "ready_s": round(ready_s, 2),
            "command": shlex.join(portkey_peer.command(entry, port)),
            "on": "provider openai with a custom host per request (x-portkey-provider, "
                  "x-portkey-custom-host), body mapped to the provider's and back, "
                  "x-portkey-* response headers",
            "off_in_open_source_gateway": "keys of its own, rate limits, budgets, usage "
                                          "metering (the client sends the upstream key)"}
    return Target("portkey", server.url, UPSTREAM_KEY, portkey_peer.SELF_REPORTED_HEADER,
                  server, info, headers=portkey_peer.headers(mock.url + "/v1", UPSTREAM_KEY))


# ----------------------------------------------------------------------------- checks


def probe(target: Target, mock: ServerProcess) -> dict[str, Any]:
    """One plain and one streamed request; raises if either is not a proper answer."""
    url = target.base_url + "/v1/chat/completions"
    sent = target.request_headers()
    status, headers, body = post_json(url, chat_body(False), None, headers=sent)
    if status != 200:
        raise RuntimeError(f"{target.name}: POST /v1/chat/completions -> {status}: {body[:500]!r}")
    reply = json.loads(body)
    checks: dict[str, Any] = {"reply": reply["choices"][0]["message"]["content"],
                              "usage": reply.get("usage"), "model": reply.get("model")}
    if target.self_header:
        checks["self_header"] = headers.get(target.self_header)
    if target.name != "direct":
        _, _, seen = http_request("GET", mock.url + "/_last_request")
        auth = json.loads(seen or b"{}").get("headers", {}).get("authorization")
        checks["upstream_saw_server_key"] = auth == f"Bearer {UPSTREAM_KEY}"
        if target.headers is not None:  # Portkey: the client sent the upstream key itself
            checks["upstream_key_sent_by_client"] = True
    status, _, body = post_json(url, chat_body(True), None, headers=sent)
    text = body.decode(errors="replace")
    if status != 200 or not text.rstrip().endswith("data: [DONE]"):
        raise RuntimeError(f"{target.name}: stream -> {status}: {text[-500:]!r}")
    checks["stream_events"] = text.count("data: ")
    checks["stream_usage"] = '"usage":{' in text.replace(" ", "")
    if target.name == "gateway":
        bad, _, _ = post_json(url, chat_body(False), "sk-sb-bogus-key")
        checks["bad_key_status"] = bad
    return checks


def metering_check(target: Target, answered: int, polls: int = 20) -> dict[str, Any]:
    """Requests the gateway metered for the tenant (``GET /v1/usage``) vs requests answered.

    Usage may be written in batches after the answer, so this polls (bounded) until the count
    reaches what was answered or stops moving.
    """
    metered, last = -1, None
    for _ in range(polls):
        status, _, body = http_request("GET", target.base_url + "/v1/usage",
                                       headers={"Authorization": f"Bearer {target.api_key}"})
        if status != 200:
            return {"answered_ok": answered, "error": f"GET /v1/usage -> {status}"}
        models = json.loads(body).get("models", [])
        metered = sum(int(m.get("requests", 0)) for m in models)
        if metered >= answered or metered == last:
            break
        last = metered
        time.sleep(0.5)
    cost = sum(int(m.get("cost_micros", 0)) for m in models) / 1e6
    return {"answered_ok": answered, "metered_requests": metered, "metered_cost_usd": cost}


# ----------------------------------------------------------------------------- measurement


def run_loadgen(target: Target, stream: bool, concurrency: int, settings: Settings,
                pin: Pinning, path: str = "/v1/chat/completions",
                body: dict[str, Any] | None = None,
                headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One measurement in a fresh load-generator process; its JSON result.

    By default a chat completion with the target's own headers; ``path``, ``body`` and
    ``headers`` measure another surface (``bench/surfaces_overhead.py``)."""
    return loadgen(target.base_url + path, chat_body(stream) if body is None else body,
                   target.request_headers() if headers is None else headers, concurrency,
                   settings, pin, collect=target.self_header)


def loadgen(url: str, body: dict[str, Any], headers: dict[str, str], concurrency: int,
            settings: Settings, pin: Pinning, *, collect: str | None) -> dict[str, Any]:
    """`bench/common/gateway_loadgen.py` in its own process, one request body over and over."""
    spec = {"url": url, "body": json.dumps(body, separators=(",", ":")), "headers": headers,
            "concurrency": concurrency, "requests": settings.requests,
            "duration_s": settings.duration_s, "warmup_requests": settings.warmup_requests,
            "warmup_s": settings.warmup_s, "grace_s": settings.grace_s,
            "collect_header": collect}
    argv = pin.wrap(pin.loadgen, [python(), str(ROOT / "bench" / "common" / "gateway_loadgen.py")])
    timeout = settings.warmup_s + settings.duration_s + 2 * settings.grace_s + 60
    done = subprocess.run(argv, input=json.dumps(spec), capture_output=True, text=True,
                          timeout=timeout, check=False, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"load generator exited {done.returncode}: {done.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    if "error" in result:
        raise RuntimeError(f"load generator: {result['error']}")
    return result


def measure(target: Target, mock: ServerProcess, stream: bool, concurrency: int,
            settings: Settings, pin: Pinning, **request: Any) -> dict[str, Any]:
    """Run one measurement and add the CPU time the servers spent on it.

    ``request`` (path, body, headers) goes to ``run_loadgen``: another surface than chat."""
    servers = [mock] + ([target.server] if target.server is not None else [])
    before = [s.cpu_seconds() for s in servers]
    t0 = time.monotonic()
    res = run_loadgen(target, stream, concurrency, settings, pin, **request)
    call_s = time.monotonic() - t0
    spent = [s.cpu_seconds() - b for s, b in zip(servers, before, strict=True)]
    served = res["completed"] + res["warmup"]["completed"]
    statuses = res.get("statuses", {})
    errors = sum(n for code, n in statuses.items() if not 200 <= int(code) < 300)
    warm_ok = sum(n for code, n in res["warmup"]["statuses"].items() if 200 <= int(code) < 300)
    row = {"system": target.name, "stream": stream, "concurrency": concurrency,
           "completed": res["completed"], "answered_ok": res["ok"] + warm_ok,
           "errors": errors + res["socket_errors"],
           "statuses": statuses, "wall_s": res["wall_s"], "rps": res["rps"],
           "latency_ms": res["latency_ms"], "ttfb_ms": res["ttfb_ms"],
           "self_reported_ms": {"header": target.self_header, **res["header_ms"],
                                "samples": res["header_samples"]},
           "loadgen_cpu_share": res["loadgen_cpu_share"],
           "mock_cpu_ms_per_req": round(spent[0] * 1000 / max(served, 1), 4),
           "mock_cpu_share": round(spent[0] / call_s, 4)}
    if target.server is not None:
        row["server_cpu_ms_per_req"] = round(spent[1] * 1000 / max(served, 1), 4)
        row["server_cpu_share"] = round(spent[1] / call_s, 4)
    return row


def measure_system(target: Target, mock: ServerProcess, concurrencies: list[int],
                   settings: Settings, pin: Pinning) -> list[dict[str, Any]]:
    rows = []
    for stream in (False, True):
        for c in concurrencies:
            row = measure(target, mock, stream, c, settings, pin)
            lat = row["latency_ms"]
            print(f"  {target.name:8s} {'stream' if stream else 'plain':6s} c={c:<4d} "
                  f"rps={row['rps']:9.1f} p50={lat['p50']}ms p99={lat['p99']}ms "
                  f"errors={row['errors']}", flush=True)
            rows.append(row)
    return rows


def add_deltas(rows: list[dict[str, Any]]) -> None:
    """Added latency vs the direct run at the same mode and concurrency."""
    direct = {(r["stream"], r["concurrency"]): r for r in rows if r["system"] == "direct"}
    for r in rows:
        base = direct.get((r["stream"], r["concurrency"]))
        if r["system"] == "direct" or base is None:
            continue
        r["added_ms"] = {q: _sub(r["latency_ms"][q], base["latency_ms"][q])
                         for q in ("p50", "p99")}


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 4)


# ----------------------------------------------------------------------------- report


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two gateway targets per mode; ``met`` is None where a side is missing."""
    by = {(r["system"], r["stream"], r["concurrency"]): r for r in rows}
    out: list[dict[str, Any]] = []
    for stream in (False, True):
        mode = "stream" if stream else "plain"
        gw = by.get(("gateway", stream, 1))
        added = (gw or {}).get("added_ms", {}).get("p50")
        out.append({"target": f"gateway added latency p50 at c=1 ({mode})",
                    "value_ms": added, "limit_ms": TARGET_ADDED_P50_MS,
                    "met": None if added is None else added <= TARGET_ADDED_P50_MS})
        for peer, label in (("litellm", "LiteLLM"), ("portkey", "Portkey")):
            gw, other = by.get(("gateway", stream, 32)), by.get((peer, stream, 32))
            ratio = gw["rps"] / other["rps"] if gw and other and other["rps"] > 0 else None
            entry: dict[str, Any] = {"target": f"gateway RPS at c=32 vs {label} ({mode})",
                                     "value_ratio": None if ratio is None else round(ratio, 2)}
            if peer == "litellm":  # issue 3's bar; Portkey is a comparison without one
                entry.update(limit_ratio=TARGET_RPS_RATIO,
                             met=None if ratio is None else ratio >= TARGET_RPS_RATIO)
            else:
                entry.update(limit_ratio=None, met=None, comparison=True)
            out.append(entry)
    return out


def target_line(t: dict[str, Any]) -> str:
    if t.get("comparison"):
        value = "-" if t["value_ratio"] is None else f"{t['value_ratio']:.2f}x"
        return f"comparison: {t['target']}: {value}"
    if t["met"] is None:
        return f"target: {t['target']}: not evaluated (a system was not measured)"
    value = (f"{t['value_ms']:.3f} ms (<= {t['limit_ms']} ms)" if "value_ms" in t
             else f"{t['value_ratio']:.2f}x (>= {t['limit_ratio']}x)")
    return f"target: {t['target']}: {value} -> {'MET' if t['met'] else 'NOT MET'}"


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("mode", "conc", "system", "RPS", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms",
            "TTFB p50", "self p50", "errors", "srv CPU ms/req", "srv CPU", "mock CPU",
            "loadgen CPU")
    lines = [head]
    order = {name: i for i, name in enumerate(SYSTEMS)}
    for r in sorted(rows, key=lambda r: (r["stream"], r["concurrency"], order[r["system"]])):
        added = r.get("added_ms", {})
        lines.append((
            "stream" if r["stream"] else "plain", str(r["concurrency"]), r["system"],
            _fmt(r["rps"], 1), _fmt(r["latency_ms"]["p50"], 3), _fmt(r["latency_ms"]["p99"], 3),
            _fmt(added.get("p50"), 3), _fmt(added.get("p99"), 3), _fmt(r["ttfb_ms"]["p50"], 3),
            _fmt(r["self_reported_ms"].get("p50"), 3), str(r["errors"]),
            _fmt(r.get("server_cpu_ms_per_req"), 3),
            _pct(r.get("server_cpu_share")), _pct(r["mock_cpu_share"]),
            _pct(r["loadgen_cpu_share"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
                     for line in lines)


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def machine() -> dict[str, Any]:
    import psutil

    return {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
            "cpu_family_model": cpu_family_model(), "cpu_flags": simd_flags(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "hostname": platform.node()}


def command_line(argv: list[str] | None) -> str:
    """How this run was started, with the interpreter relative to the repository."""
    exe = Path(sys.executable)
    shown = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else exe.name
    args = sys.argv[1:] if argv is None else argv
    return shlex.join([shown, "bench/gateway_overhead.py", *args])


def load_average() -> list[float]:
    """1/5/15-minute load averages: how busy the (shared) machine was."""
    return [round(x, 2) for x in os.getloadavg()]


def git_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT, check=False, timeout=30)
    return done.stdout.strip() or None


def report(result: dict[str, Any]) -> str:
    """The closing text: notes on what was not measured, the table, targets, fairness."""
    out = []
    for name, info in result["systems"].items():
        if not info.get("ok"):
            out.append(f"!! {name} could not be measured: {info.get('error')}")
    rows = result["results"]
    out.append(table(rows) if rows else "(no measurements)")
    out.extend(target_line(t) for t in result["targets"])
    meter = result["systems"].get("gateway", {}).get("metering")
    if meter:
        out.append(f"gateway metering: {meter.get('metered_requests')} of "
                   f"{meter['answered_ok']} answered requests metered "
                   f"(${meter.get('metered_cost_usd')}) {meter.get('error', '')}".rstrip())
    shares = [r["loadgen_cpu_share"] for r in rows]
    if shares:
        out.append(f"load generator: {result['loadgen']}; its CPU use per run "
                   f"{min(shares) * 100:.0f}%..{max(shares) * 100:.0f}% of one core")
    out.append(f"pinning: {result['pinning']['description']}")
    m = result["machine"]
    out.append(f"machine: {m['cpu_count']} CPUs, {m['cpu_model']}, {m['cpu_family_model']} "
               f"({' '.join(m['cpu_flags'])}); date {result['date']}; load average "
               f"{result['load_average_start'][0]} at start, "
               f"{result['load_average_end'][0]} at end")
    return "\n".join(out)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short measurements (~3 s each)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)))
    p.add_argument("--requests", type=int, help="requests per measurement (upper bound)")
    p.add_argument("--duration", type=float, help="seconds per measurement (upper bound)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/...)")
    p.add_argument("--keep-tmp", action="store_true", help="keep logs and databases")
    p.add_argument("--server", choices=("uvicorn", "granian"), default="uvicorn",
                   help="the HTTP server under the gateway (SWITCHBOARD_SERVER)")
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems: {sorted(unknown)}")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    base = QUICK if args.quick else STANDARD
    return Settings(requests=args.requests or base.requests,
                    duration_s=args.duration or base.duration_s,
                    warmup_requests=base.warmup_requests, warmup_s=base.warmup_s,
                    grace_s=base.grace_s)


def is_standard(args: argparse.Namespace) -> bool:
    """Whether this run is the recorded standard one (all systems, sizes, concurrencies)."""
    return (not args.quick and args.requests is None and args.duration is None
            and args.server == "uvicorn" and args.systems == ",".join(SYSTEMS)
            and args.concurrency == ",".join(map(str, CONCURRENCIES)))


STARTERS = {"gateway": start_gateway, "litellm": start_litellm, "portkey": start_portkey}


def run_system(name: str, tmp: Path, mock: ServerProcess, concurrencies: list[int],
               settings: Settings, pin: Pinning, server: str = "uvicorn"
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start, check and measure one system; (status, rows). Never raises."""
    print(f"{name}: starting", flush=True)
    target: Target | None = None
    status: dict[str, Any]
    try:
        if name == "direct":
            target = Target("direct", mock.url, UPSTREAM_KEY)
        else:
            target = (start_gateway(tmp, mock, pin, server) if name == "gateway"
                      else STARTERS[name](tmp, mock, pin))
        checks = probe(target, mock)
        rows = measure_system(target, mock, concurrencies, settings, pin)
        status = {"ok": True, "checks": checks, **target.info}
        if name == "gateway":  # probe: one plain and one streamed request answered
            status["metering"] = metering_check(target, 2 + sum(r["answered_ok"] for r in rows))
        return status, rows
    except Exception as exc:
        print(f"{name}: FAILED: {exc}", flush=True)
        status = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc()[-3000:]}
        if target is not None and target.server is not None:
            status["log_tail"] = target.server.log_tail()
        return status, []
    finally:
        if target is not None and target.server is not None:
            target.server.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = settings_from(args)
    pin = Pinning.plan(not args.no_pin)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if "direct" not in systems:
        systems.insert(0, "direct")  # the baseline of every "added" number
    tmp = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    print(f"gateway overhead: {settings}; {pin.describe()}; work dir {tmp}", flush=True)
    result: dict[str, Any] = {
        "benchmark": "gateway_overhead",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command_line(argv),
        "git_commit": git_commit(), "machine": machine(), "settings": asdict(settings),
        "pinning": pin.as_dict(),
        "loadgen": "bench/common/gateway_loadgen.py (raw asyncio + uvloop, closed loop, "
                   "keep-alive, one process)",
        "request": {"path": "/v1/chat/completions", "plain": chat_body(False),
                    "stream": chat_body(True)},
        "load_average_start": load_average(), "systems": {}, "results": []}
    mock = start_mock(tmp, pin)
    try:
        for name in systems:
            status, rows = run_system(name, tmp, mock, concurrencies, settings, pin,
                                      args.server)
            result["systems"][name] = status
            result["results"].extend(rows)
    finally:
        mock.stop()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result["load_average_end"] = load_average()
    add_deltas(result["results"])
    result["targets"] = targets(result["results"])
    out = args.out or RESULTS / f"gateway_overhead-cpu{'' if is_standard(args) else '-smoke'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    print(report(result))
    return result


if __name__ == "__main__":
    main()
