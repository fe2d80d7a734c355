"""Exact-cache hits through the gateway: what a hit costs next to the gateway's own overhead.

Run from the repository root:

    .venv/bin/python bench/cache_hit.py            # ~5 s per measurement
    .venv/bin/python bench/cache_hit.py --quick

It starts the instant mock upstream and `gateway.cli serve` (SQLite, in-process caches; the
same setup as bench/gateway_overhead.py), then measures, at each concurrency, one deterministic
request (temperature 0) sent over and over:

- ``direct``: straight to the mock;
- ``miss``: through the gateway with ``x-switchboard-cache: off`` (the full path to the
  upstream: auth, limits, routing, relay, metering);
- ``hit``: through the gateway with the cache on: the first request stores the answer, every
  later one is an exact hit (the load generator's warmup includes the first);
- ``hit-stream``: the same, streamed (the cached answer replayed as SSE).

The gateway's own overhead is ``miss - direct`` (p50). The target: a hit's p50 is at most that
overhead plus 2 ms. Writes ``bench/results/cache_hit-cpu.json`` (``-smoke`` for ``--quick``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common.gateway_procs import Pinning  # noqa: E402
from bench.gateway_overhead import (  # noqa: E402
    GATEWAY_HEADER,
    MODEL,
    QUICK,
    UPSTREAM_KEY,
    Settings,
    command_line,
    git_commit,
    load_average,
    loadgen,
    machine,
    start_gateway,
    start_mock,
)

RESULTS = ROOT / "bench" / "results"
STANDARD = Settings(requests=10_000, duration_s=5.0, warmup_requests=500, warmup_s=1.0)
TARGET_ADDED_MS = 2.0
BODY = {"model": MODEL, "temperature": 0, "max_tokens": 16, "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Say hello in one short sentence."}]}


def check_hit(base_url: str, key: str) -> dict[str, str]:
    """One request by hand: the headers of an exact hit (after one miss stored it)."""
    def send() -> dict[str, str]:
        req = urllib.request.Request(base_url + "/v1/chat/completions", method="POST",
                                     data=json.dumps(BODY).encode(), headers={
                                         "authorization": f"Bearer {key}",
                                         "content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return {k.lower(): v for k, v in resp.headers.items()}

    send()
    time.sleep(0.3)  # the store runs after the answer
    headers = send()
    if headers.get("x-cache") != "hit":
        raise RuntimeError(f"expected an exact hit, got headers {headers}")
    return {k: headers[k] for k in ("x-cache", "x-cache-kind", GATEWAY_HEADER) if k in headers}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else STANDARD
    pin = Pinning.plan(not args.no_pin)
    tmp = Path(tempfile.mkdtemp(prefix="cache-hit-"))
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "cache_hit", "date": datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"),
        "command": command_line(argv), "git_commit": git_commit(), "machine": machine(),
        "settings": settings.__dict__, "pinning": pin.as_dict(), "request": BODY,
        "load_average_start": load_average()}
    mock = start_mock(tmp, pin)
    gateway = None
    try:
        gateway = start_gateway(tmp, mock, pin)
        result["check"] = check_hit(gateway.base_url, gateway.api_key)
        auth = {"Authorization": f"Bearer {gateway.api_key}"}
        cases = [
            ("direct", mock.url, BODY, {"Authorization": f"Bearer {UPSTREAM_KEY}"}, None),
            ("miss", gateway.base_url, BODY, {**auth, "x-switchboard-cache": "off"},
             GATEWAY_HEADER),
            ("hit", gateway.base_url, BODY, auth, GATEWAY_HEADER),
            ("hit-stream", gateway.base_url, {**BODY, "stream": True}, auth, GATEWAY_HEADER),
        ]
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            for name, base, body, headers, collect in cases:
                res = loadgen(base + "/v1/chat/completions", body, headers, concurrency,
                              settings, pin, collect=collect)
                bad = sum(n for code, n in res["statuses"].items() if not 200 <= int(code) < 300)
                row = {"case": name, "concurrency": concurrency, "rps": res["rps"],
                       "latency_ms": res["latency_ms"], "self_reported_ms": res["header_ms"],
                       "completed": res["completed"], "errors": bad + res["socket_errors"]}
                rows.append(row)
                print(f"  {name:10s} c={concurrency:<3d} rps={res['rps']:9.1f} "
                      f"p50={res['latency_ms']['p50']}ms p99={res['latency_ms']['p99']}ms "
                      f"errors={row['errors']}", flush=True)
    finally:
        if gateway is not None and gateway.server is not None:
            gateway.server.stop()
        mock.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    result["results"] = rows
    result["summary"] = summary(rows)
    result["load_average_end"] = load_average()
    out = args.out or RESULTS / f"cache_hit-cpu{'-smoke' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out}")
    return result


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: the gateway's overhead (miss - direct), and a hit next to it."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        p50 = {r["case"]: r["latency_ms"]["p50"] for r in rows if r["concurrency"] == c}
        if None in p50.values() or len(p50) < 4:
            continue
        overhead = p50["miss"] - p50["direct"]
        out.append({"concurrency": c, "gateway_overhead_p50_ms": round(overhead, 3),
                    "hit_p50_ms": p50["hit"], "hit_stream_p50_ms": p50["hit-stream"],
                    "hit_added_over_overhead_ms": round(p50["hit"] - overhead, 3),
                    "target_ms": TARGET_ADDED_MS,
                    "met": p50["hit"] - overhead <= TARGET_ADDED_MS})
    return out


if __name__ == "__main__":
    main()
