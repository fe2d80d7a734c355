"""Surfaces overhead: what /v1/messages and /v1/responses add over /v1/chat/completions.

Run from the repository root (one command, everything in one run, a few minutes):

    .venv/bin/python bench/surfaces_overhead.py            # standard: 3 s a measurement, 3 rounds
    .venv/bin/python bench/surfaces_overhead.py --quick    # 1.5 s, 1 round (smoke)

The same question (a system prompt, one user message, at most 16 output tokens) is asked over
every surface of one system, against the instant mock upstream of ``bench/gateway_overhead.py``
(whose machinery this reuses: mock, gateway and LiteLLM setup, pinning, the load generator, CPU
accounting):

- ``direct``: the mock's own ``/v1/chat/completions`` (the baseline of every "added" figure);
- ``gateway``: Switchboard with a tenant key, limits and metering on, as in gateway_overhead:
  ``chat`` (``/v1/chat/completions``), ``messages`` (``/v1/messages``, the key in
  ``x-api-key`` with ``anthropic-version`` as the anthropic SDK sends it), ``responses``
  (``/v1/responses`` with ``store`` left at its default, true: the answer is written to the
  database) and ``responses-nostore`` (``store: false``). Messages and Responses are translated
  to a chat completion for the mock (an OpenAI-compatible upstream);
- ``litellm``: LiteLLM Proxy 1.106.0 (``bench/common/litellm_peer.py``), ``chat`` and ``messages``
  (its ``/v1/messages`` translates to the OpenAI upstream as well), the peer.

``/v1/responses`` is measured if the gateway serves the route; if not, it is skipped with a
note. Portkey's open gateway is no peer here: its ``/v1/messages`` refuses an OpenAI upstream.

Each point (plain and streamed, concurrency 1 and 32) measures every surface of a system back
to back, in an order that alternates between rounds, so the shared machine's drift falls on all
of them alike; the figures are the median over rounds. "Added" is a surface's latency minus the
direct run's at the same point; "x chat" is a surface's added latency over chat's on the same
system (the issue's target: at most 1.1x for p50 and p99). Server CPU per request is the
steadier figure on a busy machine and gets its own ratio.

Writes ``bench/results/surfaces_overhead-cpu.json`` (``-smoke.json``, git-ignored, for any
non-standard run) with the machine (``lscpu`` model and SIMD flags) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(ROOT))

from bench import gateway_overhead as go  # noqa: E402
from bench.common.gateway_procs import Pinning, ServerProcess, post_json  # noqa: E402

CONCURRENCIES = (1, 32)
TARGET_RATIO = 1.1
ANTHROPIC_VERSION = "2023-06-01"
SYSTEM_PROMPT, QUESTION = go.MESSAGES[0]["content"], go.MESSAGES[1]["content"]
SURFACES = {"gateway": ("chat", "messages", "responses", "responses-nostore"),
            "litellm": ("chat", "messages")}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages",
         "responses": "/v1/responses", "responses-nostore": "/v1/responses"}
STANDARD = go.Settings(requests=5_000, duration_s=3.0, warmup_requests=300, warmup_s=1.0)
STANDARD_ROUNDS = 3
QUICK = go.Settings(requests=2_000, duration_s=1.5, warmup_requests=100, warmup_s=0.5)


def body(surface: str, stream: bool) -> dict[str, Any]:
    """The same question and output bound on each surface."""
    if surface == "chat":
        return go.chat_body(stream)
    if surface == "messages":
        out: dict[str, Any] = {"model": go.MODEL, "system": SYSTEM_PROMPT, "max_tokens": 16,
                               "messages": [{"role": "user", "content": QUESTION}]}
    else:
        out = {"model": go.MODEL, "instructions": SYSTEM_PROMPT, "input": QUESTION,
               "max_output_tokens": 16}
        if surface == "responses-nostore":
            out["store"] = False
    if stream:
        out["stream"] = True
    return out


def headers(target: go.Target, surface: str) -> dict[str, str]:
    """Messages: the key in x-api-key with anthropic-version (the anthropic SDK's way)."""
    if surface == "messages":
        return {"x-api-key": target.api_key, "anthropic-version": ANTHROPIC_VERSION}
    return target.request_headers()


# ----------------------------------------------------------------------------- checks


def check_answer(surface: str, stream: bool, status: int, raw: bytes) -> str | None:
    """Why an answer is not a proper one of its surface (None when it is)."""
    text = raw.decode(errors="replace")
    if status != 200:
        return f"HTTP {status}: {text[:400]!r}"
    expect = {("chat", False): '"chat.completion"', ("chat", True): "data:[DONE]",
              ("messages", False): '"type":"message"', ("messages", True): "message_stop",
              ("responses", False): '"object":"response"',
              ("responses", True): "response.completed"}
    key = ("responses" if surface.startswith("responses") else surface, stream)
    if expect[key] not in text.replace(" ", ""):
        return f"no {expect[key]!r} in the answer: {text[-400:]!r}"
    return None


def probe(target: go.Target, surfaces: tuple[str, ...]) -> tuple[list[str], dict[str, Any]]:
    """Which surfaces answer properly, plain and streamed; (served, notes per surface).

    A surface whose route is missing (404) or that fails is left out with its reason; chat must
    answer, or the system cannot be measured."""
    served, notes = [], {}
    for surface in surfaces:
        why = None
        for stream in (False, True):
            status, _, raw = post_json(target.base_url + PATHS[surface], body(surface, stream),
                                       None, headers=headers(target, surface))
            why = check_answer(surface, stream, status, raw)
            if why:
                why = f"{'streamed' if stream else 'plain'}: {why}"
                break
        if why is None:
            served.append(surface)
            notes[surface] = "ok"
            continue
        if surface == "chat":
            raise RuntimeError(f"{target.name} chat completions: {why}")
        notes[surface] = why
        print(f"NOTE: {target.name} {surface} ({PATHS[surface]}) skipped: {why}", flush=True)
    return served, notes


# ----------------------------------------------------------------------------- measurement


def measure_point(target: go.Target, mock: ServerProcess, surfaces: list[str], stream: bool,
                  c: int, settings: go.Settings, pin: Pinning, rnd: int
                  ) -> list[dict[str, Any]]:
    """Every surface at one point, back to back (reversed on odd rounds)."""
    rows = []
    for surface in surfaces if rnd % 2 == 0 else list(reversed(surfaces)):
        row = go.measure(target, mock, stream, c, settings, pin, path=PATHS[surface],
                         body=body(surface, stream), headers=headers(target, surface))
        row.update(surface=surface, round=rnd)
        lat = row["latency_ms"]
        print(f"  {target.name:8s} {surface:17s} {'stream' if stream else 'plain':6s} c={c:<3d}"
              f" round {rnd}: rps={row['rps']:8.1f} p50={lat['p50']}ms p99={lat['p99']}ms "
              f"errors={row['errors']}", flush=True)
        rows.append(row)
    return rows


def run_system(name: str, tmp: Path, mock: ServerProcess, settings: go.Settings, pin: Pinning,
               rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start, probe and measure one system on all its surfaces; never raises."""
    print(f"{name}: starting", flush=True)
    target: go.Target | None = None
    try:
        if name == "direct":
            target = go.Target("direct", mock.url, go.UPSTREAM_KEY)
            surfaces, notes = ["chat"], {"chat": "ok"}
        else:
            target = go.STARTERS[name](tmp, mock, pin)
            surfaces, notes = probe(target, SURFACES[name])
        rows = []
        for rnd in range(rounds):
            for stream in (False, True):
                for c in CONCURRENCIES:
                    rows.extend(measure_point(target, mock, surfaces, stream, c, settings, pin,
                                              rnd))
        return {"ok": True, "surfaces": notes, **target.info}, rows
    except Exception as exc:
        print(f"{name}: FAILED: {exc}", flush=True)
        status: dict[str, Any] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc()[-3000:]}
        if target is not None and target.server is not None:
            status["log_tail"] = target.server.log_tail()
        return status, []
    finally:
        if target is not None and target.server is not None:
            target.server.stop()


# ----------------------------------------------------------------------------- summary


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (system, surface, mode, concurrency): medians over rounds, added latency
    over direct, and the ratios to the same system's chat."""
    groups: dict[tuple[str, str, bool, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["surface"], r["stream"], r["concurrency"]), []).append(r)
    lines = []
    for (system, surface, stream, c), rs in groups.items():
        lines.append({
            "system": system, "surface": surface, "stream": stream, "concurrency": c,
            "rounds": len(rs), "rps": _median([r["rps"] for r in rs]),
            "p50_ms": _median([r["latency_ms"]["p50"] for r in rs]),
            "p99_ms": _median([r["latency_ms"]["p99"] for r in rs]),
            "ttfb_p50_ms": _median([r["ttfb_ms"]["p50"] for r in rs]),
            "self_reported_p50_ms": _median([r["self_reported_ms"].get("p50") for r in rs]),
            "server_cpu_ms_per_req": _median([r.get("server_cpu_ms_per_req") for r in rs]),
            "errors": sum(r["errors"] for r in rs)})
    by = {(x["system"], x["surface"], x["stream"], x["concurrency"]): x for x in lines}
    for x in lines:
        base = by.get(("direct", "chat", x["stream"], x["concurrency"]))
        if x["system"] == "direct" or base is None:
            continue
        x["added_ms"] = {q: _sub(x[f"{q}_ms"], base[f"{q}_ms"]) for q in ("p50", "p99")}
    for x in lines:
        chat = by.get((x["system"], "chat", x["stream"], x["concurrency"]))
        if x["surface"] == "chat" or "added_ms" not in x or chat is None:
            continue
        x["x_chat"] = {q: _ratio(x["added_ms"][q], chat["added_ms"][q]) for q in ("p50", "p99")}
        x["x_chat"]["cpu"] = _ratio(x["server_cpu_ms_per_req"], chat["server_cpu_ms_per_req"])
        x["minus_chat_ms"] = {q: _sub(x[f"{q}_ms"], chat[f"{q}_ms"]) for q in ("p50", "p99")}
    order = {s: i for i, s in enumerate(("direct", "gateway", "litellm"))}
    surf = {s: i for i, s in enumerate(SURFACES["gateway"])}
    lines.sort(key=lambda x: (x["stream"], x["concurrency"], order[x["system"]],
                              surf[x["surface"]]))
    return lines


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 4)


def targets(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's target per gateway surface and point, and the comparison with LiteLLM."""
    out: list[dict[str, Any]] = []
    by = {(x["system"], x["surface"], x["stream"], x["concurrency"]): x for x in lines}
    for x in lines:
        if x["system"] != "gateway" or "x_chat" not in x:
            continue
        for q in ("p50", "p99"):
            v = x["x_chat"][q]
            out.append({"target": f"gateway {x['surface']} added {q} / chat's, "
                                  f"{'stream' if x['stream'] else 'plain'} c={x['concurrency']}",
                        "value_ratio": v, "limit_ratio": TARGET_RATIO,
                        "met": None if v is None else v <= TARGET_RATIO})
    for stream in (False, True):
        for c in CONCURRENCIES:
            gw, ll = (by.get((s, "messages", stream, c)) for s in ("gateway", "litellm"))
            if gw and ll and "added_ms" in gw and "added_ms" in ll:
                out.append({"comparison": f"LiteLLM /v1/messages added p50 / the gateway's, "
                                          f"{'stream' if stream else 'plain'} c={c}",
                            "value_ratio": _ratio(ll["added_ms"]["p50"], gw["added_ms"]["p50"])})
    return out


def target_line(t: dict[str, Any]) -> str:
    v = "-" if t["value_ratio"] is None else f"{t['value_ratio']:.2f}x"
    if "comparison" in t:
        return f"comparison: {t['comparison']}: {v}"
    verdict = "not evaluated" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
    return f"target: {t['target']}: {v} (<= {t['limit_ratio']}x) -> {verdict}"


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(lines: list[dict[str, Any]]) -> str:
    head = ("mode", "conc", "system", "surface", "RPS", "p50 ms", "p99 ms", "+p50 ms",
            "+p99 ms", "x chat p50", "x chat p99", "self p50", "CPU ms/req", "x chat CPU",
            "errors")
    out = [head]
    for x in lines:
        add, vs = x.get("added_ms", {}), x.get("x_chat", {})
        out.append(("stream" if x["stream"] else "plain", str(x["concurrency"]), x["system"],
                    x["surface"], _fmt(x["rps"], 1), _fmt(x["p50_ms"]), _fmt(x["p99_ms"]),
                    _fmt(add.get("p50")), _fmt(add.get("p99")), _fmt(vs.get("p50"), 2),
                    _fmt(vs.get("p99"), 2), _fmt(x["self_reported_p50_ms"]),
                    _fmt(x["server_cpu_ms_per_req"]), _fmt(vs.get("cpu"), 2), str(x["errors"])))
    widths = [max(len(line[i]) for line in out) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
                     for line in out)


def report(result: dict[str, Any]) -> str:
    out = []
    for name, info in result["systems"].items():
        if not info.get("ok"):
            out.append(f"!! {name} could not be measured: {info.get('error')}")
        for surface, note in info.get("surfaces", {}).items():
            if note != "ok":
                out.append(f"note: {name} {surface} not measured: {note}")
    out.append(table(result["summary"]) if result["summary"] else "(no measurements)")
    out.extend(target_line(t) for t in result["targets"])
    m = result["machine"]
    out.append(f"pinning: {result['pinning']['description']}")
    out.append(f"machine: {m['cpu_count']} CPUs, {m['cpu_model']}, {m['cpu_family_model']} "
               f"({' '.join(m['cpu_flags'])}); date {result['date']}; load average "
               f"{result['load_average_start'][0]} at start, "
               f"{result['load_average_end'][0]} at end; {result['rounds']} round(s) of "
               f"{result['settings']['duration_s']} s a measurement, medians shown")
    return "\n".join(out)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1.5 s measurements, one round (smoke)")
    p.add_argument("--systems", default="direct,gateway,litellm",
                   help="comma-separated subset of direct,gateway,litellm (direct always runs)")
    p.add_argument("--rounds", type=int, help=f"rounds (default {STANDARD_ROUNDS}, quick 1)")
    p.add_argument("--duration", type=float, help="seconds per measurement (upper bound)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/...)")
    p.add_argument("--keep-tmp", action="store_true", help="keep logs and databases")
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - {"direct", "gateway", "litellm"}
    if unknown:
        p.error(f"unknown systems: {sorted(unknown)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    base = QUICK if args.quick else STANDARD
    settings = go.Settings(requests=base.requests, duration_s=args.duration or base.duration_s,
                           warmup_requests=base.warmup_requests, warmup_s=base.warmup_s)
    rounds = args.rounds or (1 if args.quick else STANDARD_ROUNDS)
    standard = (not args.quick and args.rounds is None and args.duration is None
                and args.systems == "direct,gateway,litellm")
    pin = Pinning.plan(not args.no_pin)
    systems = ["direct"] + [s for s in ("gateway", "litellm") if s in args.systems.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="surfaces-overhead-"))
    print(f"surfaces overhead: {settings}, {rounds} round(s); {pin.describe()}; work dir {tmp}",
          flush=True)
    result: dict[str, Any] = {
        "benchmark": "surfaces_overhead",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": go.command_line(argv).replace("gateway_overhead", "surfaces_overhead"),
        "git_commit": go.git_commit(), "machine": go.machine(), "settings": settings.__dict__,
        "rounds": rounds, "pinning": pin.as_dict(),
        "requests": {s: {"path": PATHS[s], "plain": body(s, False), "stream": body(s, True)}
                     for s in PATHS},
        "target": f"each gateway surface's added latency p50 and p99 at most {TARGET_RATIO}x "
                  "chat completions' (issue 39, section 6)",
        "load_average_start": go.load_average(), "systems": {}, "rows": []}
    mock = go.start_mock(tmp, pin)
    try:
        for name in systems:
            status, rows = run_system(name, tmp, mock, settings, pin, rounds)
            result["systems"][name] = status
            result["rows"].extend(rows)
    finally:
        mock.stop()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    result["load_average_end"] = go.load_average()
    result["summary"] = summarize(result["rows"])
    result["targets"] = targets(result["summary"])
    out = args.out or go.RESULTS / f"surfaces_overhead-cpu{'' if standard else '-smoke'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    print(report(result))
    return result


if __name__ == "__main__":
    main()
