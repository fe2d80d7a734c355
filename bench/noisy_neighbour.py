"""One tenant's oversized and rate-limited bodies against another tenant's latency.

`switchboard serve` on the embedded default (SmolLM2, SQLite) in its own process, with two
tenants: a hostile one on a 3-RPM plan and a normal one. The hostile tenant sends, from
`--attackers` connections at once, bodies of `--body-mb` MB (a prompt no window holds,
refused before any tokenizer runs) and mid-size prompts (tokenized off the event loop,
refused with a 429 once its 3 RPM are used: admitted on an estimate first, so they cost no
tokenizing either). Meanwhile `GET /health/live`, the normal tenant's `GET /v1/models`
(authenticated, no engine work) and its `max_tokens: 1` chat requests are timed. The same
probes are timed on the idle server first.

With `--bodies-only` the hostile tenant sends the oversized bodies alone.

Usage: .venv/bin/python bench/noisy_neighbour.py [--body-mb 3.5] [--seconds 20] [--bodies-only]
Prints a table last and writes bench/results/noisy_neighbour-cpu.json (non-default runs:
noisy_neighbour-cpu-smoke.json, which git ignores).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common.gateway_procs import (  # noqa: E402
    ServerProcess,
    free_port,
    gateway_cli,
    gateway_env,
    python,
)
from bench.common.machine import cpu_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = {"body_mb": 3.5, "seconds": 20.0, "attackers": 4}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def probe(client: httpx.AsyncClient, key: str, until: float) -> dict[str, list[float]]:
    """The liveness probe, the normal tenant's model list (authenticated, no engine) and its
    chat, one after another, until `until`."""
    times: dict[str, list[float]] = {"chat": [], "live": [], "models": []}
    body = {"model": "smollm2-135m-instruct", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi."}]}
    while time.monotonic() < until:
        started = time.perf_counter()
        r = await client.get("/health/live")
        times["live"].append((time.perf_counter() - started) * 1000)
        assert r.status_code == 200, r.text
        started = time.perf_counter()
        r = await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})
        times["models"].append((time.perf_counter() - started) * 1000)
        assert r.status_code == 200, r.text
        started = time.perf_counter()
        r = await client.post("/v1/chat/completions", json=body,
                              headers={"authorization": f"Bearer {key}",
                                       "x-switchboard-cache": "off"})
        times["chat"].append((time.perf_counter() - started) * 1000)
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.05)
    return times


async def attack(client: httpx.AsyncClient, key: str, until: float, body_mb: float,
                 prompts: bool = True) -> dict[int, int]:
    """Oversized bodies and mid-size prompts, alternately (bodies only without `prompts`);
    counts of each status seen."""
    huge = json.dumps({"model": "smollm2-135m-instruct", "messages": [
        {"role": "user", "content": "x " * int(body_mb * (1 << 20) / 2)}]}).encode()
    mid = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 1, "messages": [
        {"role": "user", "content": "word " * 4000}]}).encode()
    statuses: dict[int, int] = {}
    n = 0
    while time.monotonic() < until:
        n += 1
        r = await client.post("/v1/chat/completions",
                              content=huge if n % 2 or not prompts else mid,
                              headers={"authorization": f"Bearer {key}",
                                       "content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    return statuses


async def measure(url: str, normal: str, hostile: str, args: argparse.Namespace
                  ) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.attackers + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        idle = await probe(client, normal, time.monotonic() + args.seconds / 2)
        until = time.monotonic() + args.seconds
        attacks = [attack(client, hostile, until, args.body_mb, not args.bodies_only)
                   for _ in range(args.attackers)]
        busy, *seen = await asyncio.gather(probe(client, normal, until), *attacks)
    statuses: dict[int, int] = {}
    for counts in seen:
        for status, count in counts.items():
            statuses[status] = statuses.get(status, 0) + count
    return {"idle": idle, "busy": busy, "hostile_statuses": statuses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--body-mb", type=float, default=DEFAULTS["body_mb"])
    p.add_argument("--seconds", type=float, default=DEFAULTS["seconds"])
    p.add_argument("--attackers", type=int, default=DEFAULTS["attackers"])
    p.add_argument("--bodies-only", action="store_true",
                   help="only oversized bodies, no admissible prompts (section 1 alone)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        env = gateway_env(tmp)
        env["SWITCHBOARD_EMBEDDED__MODEL"] = "default"
        env["SWITCHBOARD_EMBEDDING_MODEL"] = "none"
        (tmp / "deployments.yaml").write_text("deployments: []\n")
        gateway_cli(["migrate"], env)
        keys = {}
        for name, rpm in (("normal", "100000"), ("hostile", "3")):
            gateway_cli(["plans", "create", "--name", name, "--rpm", rpm], env)
            tenant = gateway_cli(["tenants", "create", "--name", name, "--plan", name], env)
            keys[name] = gateway_cli(["keys", "create", "--tenant", str(tenant["id"])],
                                     env)["key"]
        port = free_port()
        server = ServerProcess("gateway", [python(), "-m", "gateway.cli", "serve", "--host",
                                           "127.0.0.1", "--port", str(port)], port,
                               tmp / "serve.log", env=env, cwd=ROOT).start()
        try:
            server.wait_ready("/health", 240)
            result = asyncio.run(measure(server.url, keys["normal"], keys["hostile"], args))
        finally:
            server.stop()
    rows = []
    for what in ("live", "models", "chat"):
        idle, busy = result["idle"][what], result["busy"][what]
        rows.append({"probe": what, "idle_p50_ms": statistics.median(idle),
                     "idle_p99_ms": percentile(idle, 0.99),
                     "busy_p50_ms": statistics.median(busy),
                     "busy_p99_ms": percentile(busy, 0.99), "busy_n": len(busy),
                     "busy_ms": [round(t, 1) for t in busy]})
    standard = all(getattr(args, k) == v for k, v in DEFAULTS.items()) and not args.bodies_only
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("noisy_neighbour-cpu.json" if standard else
                     "noisy_neighbour-cpu-smoke.json")
    out.write_text(json.dumps({"date": datetime.date.today().isoformat(),
                               "machine": cpu_model(), "command": " ".join(sys.argv),
                               "rows": rows, "hostile_statuses": result["hostile_statuses"]},
                              indent=2))
    print(f"\n{args.attackers} hostile connections, {args.body_mb} MB bodies and 4,000-word "
          f"prompts on a 3-RPM plan, {args.seconds:.0f} s; {cpu_model()}")
    print(f"hostile answers by status: {result['hostile_statuses']}")
    print("| probe | idle p50 | idle p99 | under attack p50 | under attack p99 | n |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['probe']} | {r['idle_p50_ms']:.1f} ms | {r['idle_p99_ms']:.1f} ms "
              f"| {r['busy_p50_ms']:.1f} ms | {r['busy_p99_ms']:.1f} ms | {r['busy_n']} |")


if __name__ == "__main__":
    main()
