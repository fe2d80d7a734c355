"""Surface overhead: the latency the gateway adds on /v1/responses and /v1/messages against
chat completions, in one run, over the instant mock upstream.

Run from the repository root:

    .venv/bin/python bench/surface_overhead.py            # standard: ~10 s per measurement
    .venv/bin/python bench/surface_overhead.py --quick    # ~3 s per measurement

One gateway (``python -m gateway.cli serve`` on a fresh SQLite database, a tenant key, one
deployment on the mock: as ``bench/gateway_overhead.py`` sets it up) serves the same question
on each surface: chat completions, Responses with ``store`` (the default: the answer is written
to the database before its last byte), Responses with ``store: false``, and Anthropic
Messages; non-streamed and streamed, at concurrency 1 and 32. The mock alone (``direct``) is
measured at the same points, so each surface's added latency is its p50 (p99) minus the
direct run's, and its ratio is that over chat's (the target: at most 1.1x). The gateway's CPU
time a request is kept too: on a busy machine latency mostly measures the neighbours, CPU time
does not. Each measurement is one ``bench/gateway_loadgen.py`` process; processes are pinned
as in gateway_overhead.

Writes ``bench/results/surface_overhead-cpu.json`` (``-smoke.json`` for a quick run, ignored
by git) and prints a table. LiteLLM Proxy's /v1/messages as a peer is not measured here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import (  # noqa: E402
    GATEWAY_HEADER,
    MESSAGES,
    MODEL,
    QUICK,
    RESULTS,
    STANDARD,
    Settings,
    chat_body,
    git_commit,
    loadgen,
    start_gateway,
    start_mock,
)
from bench.gateway_procs import Pinning, post_json  # noqa: E402
from bench.machine import cpu_model  # noqa: E402

CONCURRENCIES = (1, 32)
TARGET_RATIO = 1.1
SYSTEM, QUESTION = MESSAGES[0]["content"], MESSAGES[1]["content"]


def bodies(stream: bool) -> dict[str, tuple[str, dict[str, Any]]]:
    """Surface -> (path, body): the same question and output bound on each."""
    responses = {"model": MODEL, "instructions": SYSTEM, "input": QUESTION,
                 "max_output_tokens": 16, "stream": stream}
    return {
        "chat": ("/v1/chat/completions", chat_body(stream)),
        "responses": ("/v1/responses", responses),
        "responses-nostore": ("/v1/responses", {**responses, "store": False}),
        "messages": ("/v1/messages", {"model": MODEL, "system": SYSTEM, "max_tokens": 16,
                                      "messages": [{"role": "user", "content": QUESTION}],
                                      "stream": stream}),
    }


def probe(base_url: str, key: str) -> dict[str, Any]:
    """Each surface answers 200, plain and streamed."""
    seen = {}
    for stream in (False, True):
        for name, (path, body) in bodies(stream).items():
            status, _, raw = post_json(base_url + path, body, key)
            if status != 200:
                raise RuntimeError(f"{name} {path} -> {status}: {raw[:300]!r}")
            seen[f"{name}{'-stream' if stream else ''}"] = len(raw)
    return seen


def row_of(surface: str, stream: bool, c: int, res: dict[str, Any]) -> dict[str, Any]:
    statuses = res.get("statuses", {})
    return {"surface": surface, "stream": stream, "concurrency": c, "rps": res["rps"],
            "completed": res["completed"],
            "errors": sum(n for code, n in statuses.items() if not 200 <= int(code) < 300)
            + res["socket_errors"],
            "latency_ms": res["latency_ms"], "ttfb_ms": res["ttfb_ms"],
            "self_reported_ms": res["header_ms"]}


def added(rows: list[dict[str, Any]]) -> None:
    """Each gateway row's added p50/p99 over direct, and its ratio to chat's."""
    direct = {(r["stream"], r["concurrency"]): r for r in rows if r["surface"] == "direct"}
    for r in rows:
        base = direct.get((r["stream"], r["concurrency"]))
        if r["surface"] == "direct" or base is None:
            continue
        r["added_ms"] = {q: round(r["latency_ms"][q] - base["latency_ms"][q], 3)
                         for q in ("p50", "p99")}
    chat = {(r["stream"], r["concurrency"]): r for r in rows if r["surface"] == "chat"}
    for r in rows:
        base = chat.get((r["stream"], r["concurrency"]))
        if "added_ms" not in r or base is None or r["surface"] == "chat":
            continue
        r["vs_chat"] = {q: (round(r["added_ms"][q] / base["added_ms"][q], 3)
                            if base["added_ms"][q] > 0 else None) for q in ("p50", "p99")}
        if base.get("server_cpu_ms_per_req"):
            r["vs_chat"]["cpu"] = round(r["server_cpu_ms_per_req"]
                                        / base["server_cpu_ms_per_req"], 3)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'surface':18s} {'mode':6s} {'c':>3s} {'rps':>9s} {'p50':>8s} {'p99':>8s} "
             f"{'+p50':>7s} {'+p99':>7s} {'x chat p50':>10s} {'x chat p99':>10s} "
             f"{'cpu ms/req':>10s}"]
    for r in rows:
        add = r.get("added_ms", {})
        vs = r.get("vs_chat", {})
        lines.append(
            f"{r['surface']:18s} {'stream' if r['stream'] else 'plain':6s} "
            f"{r['concurrency']:3d} {r['rps']:9.1f} {r['latency_ms']['p50']:8.3f} "
            f"{r['latency_ms']['p99']:8.3f} {_f(add.get('p50')):>7s} {_f(add.get('p99')):>7s} "
            f"{_f(vs.get('p50')):>10s} {_f(vs.get('p99')):>10s} "
            f"{_f(r.get('server_cpu_ms_per_req')):>10s}")
    return "\n".join(lines)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-pin", action="store_true")
    args = parser.parse_args(argv)
    settings: Settings = QUICK if args.quick else STANDARD
    pin = Pinning.plan(not args.no_pin)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="surface-bench-") as tmp_name:
        tmp = Path(tmp_name)
        mock = start_mock(tmp, pin)
        try:
            target = start_gateway(tmp, mock, pin)
            try:
                checks = probe(target.base_url, target.api_key)
                for stream in (False, True):
                    for c in CONCURRENCIES:
                        direct = loadgen(mock.url + "/v1/chat/completions", chat_body(stream),
                                         {}, c, settings, pin, collect=None)
                        rows.append(row_of("direct", stream, c, direct))
                        for name, (path, body) in bodies(stream).items():
                            server = target.server
                            before = server.cpu_seconds() if server is not None else 0.0
                            res = loadgen(target.base_url + path, body,
                                          {"Authorization": f"Bearer {target.api_key}"}, c,
                                          settings, pin, collect=GATEWAY_HEADER)
                            row = row_of(name, stream, c, res)
                            if server is not None:  # the gateway's CPU a request (load-proof)
                                served = res["completed"] + res["warmup"]["completed"]
                                row["server_cpu_ms_per_req"] = round(
                                    (server.cpu_seconds() - before) * 1000 / max(served, 1), 4)
                            rows.append(row)
                            print(f"  {name:18s} {'stream' if stream else 'plain':6s} c={c:<3d}"
                                  f" p50={res['latency_ms']['p50']}ms", flush=True)
            finally:
                if target.server is not None:
                    target.server.stop()
        finally:
            mock.stop()
    added(rows)
    result = {"benchmark": "surface_overhead", "date": datetime.datetime.now(
        datetime.UTC).isoformat(timespec="seconds"), "commit": git_commit(),
        "machine": {"cpu": cpu_model(), "python": platform.python_version()},
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "settings": settings.__dict__, "pinning": pin.describe(),
        "target": f"added latency at most {TARGET_RATIO}x chat's", "probe": checks,
        "rows": rows}
    name = "surface_overhead-cpu" + ("-smoke" if args.quick else "") + ".json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    return result


if __name__ == "__main__":
    main()
