"""A live tenant's time to first token with another tenant's batch running, against without.

`switchboard serve` on the embedded engine (SmolLM2 by default, SQLite) in its own process,
two tenants on equal plans. The live tenant sends streamed chat requests one after another
(`--requests` per phase, `--think-s` apart, each prompt different so no cache helps); its
TTFT is the time to the first content delta. Phases alternate for `--rounds` rounds: alone,
then while the other tenant's batch of `--lines` chat lines (`--batch-max-tokens` each) runs
through the Batch API (measured from its first answered line; cancelled, and the cancel
awaited, before the next phase). `--neighbour live` is the comparison: the other tenant sends
the same lines as live requests, one at a time. The batch worker's settings are the
gateway's defaults unless `--batch-concurrency` / `--under-load` say otherwise. `--model
tiny` serves a random 4-layer Llama with SmolLM2's tokenizer (the same scheduling, for a CPU
too busy for SmolLM2). The gateway's own view (usage records: arrival to dispatch, and to
the first token) is printed beside the client's.

Usage: .venv/bin/python bench/batch_priority.py [--lines 1000] [--requests 60] [--rounds 2]
       [--model default|tiny|PATH] [--neighbour batch|live] [--batch-concurrency N]
       [--under-load N]
Prints a table last and writes bench/results/batch_priority-cpu.json (non-default runs:
batch_priority-cpu-smoke.json, which git ignores).
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
MODEL = "smollm2-135m-instruct"
DEFAULTS = {"lines": 1000, "requests": 60, "think_s": 0.25, "live_max_tokens": 16,
            "batch_max_tokens": 32, "model": "default", "batch_concurrency": None,
            "under_load": None, "neighbour": "batch", "rounds": 2}
TOPICS = ("rivers", "bridges", "comets", "forests", "markets", "glaciers", "violins",
          "deserts", "harbors", "volcanoes", "libraries", "satellites")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(ttfts: list[float]) -> dict[str, float]:
    return {"n": len(ttfts), "p50_ms": statistics.median(ttfts),
            "p90_ms": percentile(ttfts, 0.90), "p99_ms": percentile(ttfts, 0.99),
            "max_ms": max(ttfts)}


async def ttft(client: httpx.AsyncClient, key: str, n: int, max_tokens: int) -> float:
    """One streamed chat request; ms to its first content delta."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"Request {n}: write two sentences "
                          f"about {TOPICS[n % len(TOPICS)]} and the number {n}."}]}
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}",
                                      "x-switchboard-cache": "off"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0].get("delta") or {}
                if delta.get("content"):
                    first = time.perf_counter()
    assert first is not None, "no content streamed"
    return (first - started) * 1000


async def live_tenant(client: httpx.AsyncClient, key: str, args: argparse.Namespace,
                      offset: int) -> list[float]:
    times = []
    for i in range(args.requests):
        times.append(await ttft(client, key, offset + i, args.live_max_tokens))
        await asyncio.sleep(args.think_s)
    return times


def batch_file(args: argparse.Namespace) -> bytes:
    lines = []
    for i in range(args.lines):
        lines.append(json.dumps({
            "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": args.batch_max_tokens,
                     "messages": [{"role": "user", "content": f"Item {i}: summarize what "
                                   f"you know about {TOPICS[i % len(TOPICS)]} in one "
                                   "paragraph."}]}}))
    return ("\n".join(lines) + "\n").encode()


async def batch_counts(client: httpx.AsyncClient, key: str, batch_id: str) -> dict[str, Any]:
    r = await client.get(f"/v1/batches/{batch_id}", headers={"authorization": f"Bearer {key}"})
    r.raise_for_status()
    return r.json()


class Neighbour:
    """The other tenant's work during a "with" phase: the batch (uploaded, created, and
    cancelled at the end of the phase, the cancel awaited so the next phase is alone), or
    with `--neighbour live` the same lines as live chat requests, one after another."""

    def __init__(self, client: httpx.AsyncClient, key: str, args: argparse.Namespace,
                 round_no: int) -> None:
        self.client, self.args, self.round_no = client, args, round_no
        self.auth = {"authorization": f"Bearer {key}"}
        self.done = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.batch_id: str | None = None

    async def start(self) -> None:
        if self.args.neighbour == "live":
            self._task = asyncio.create_task(self._live())
        else:
            r = await self.client.post("/v1/files", headers=self.auth, data={"purpose": "batch"},
                                       files={"file": ("batch.jsonl", batch_file(self.args))})
            r.raise_for_status()
            r = await self.client.post("/v1/batches", headers=self.auth, json={
                "input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h", "metadata": {"round": str(self.round_no)}})
            r.raise_for_status()
            self.batch_id = r.json()["id"]
        deadline = time.monotonic() + 600
        while await self.count() < 1:  # under way: its first line answered
            assert time.monotonic() < deadline, "the neighbour did not start"
            await asyncio.sleep(0.2)

    async def count(self) -> int:
        if self.batch_id is None:
            return self.done
        r = await self.client.get(f"/v1/batches/{self.batch_id}", headers=self.auth)
        r.raise_for_status()
        return int(r.json()["request_counts"]["completed"])

    async def stop(self) -> None:
        if self.batch_id is None:
            self._stop.set()
            assert self._task is not None
            await self._task
            return
        await self.client.post(f"/v1/batches/{self.batch_id}/cancel", headers=self.auth)
        while True:
            r = await self.client.get(f"/v1/batches/{self.batch_id}", headers=self.auth)
            if r.json()["status"] in ("cancelled", "completed", "failed", "expired"):
                return
            await asyncio.sleep(0.2)

    async def _live(self) -> None:
        for line in batch_file(self.args).splitlines():
            if self._stop.is_set():
                return
            r = await self.client.post("/v1/chat/completions", json=json.loads(line)["body"],
                                       headers={**self.auth, "x-switchboard-cache": "off"})
            r.raise_for_status()
            self.done += 1


async def measure(url: str, live_key: str, batch_key: str, args: argparse.Namespace
                  ) -> dict[str, Any]:
    """Rounds of (alone, with the neighbour), so drift in the machine's load falls on both."""
    alone: list[float] = []
    busy: list[float] = []
    done, window = 0, 0.0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for i in range(3):  # warm the engine
            await ttft(client, live_key, 10_000 + i, 4)
        for round_no in range(args.rounds):
            offset = 2 * round_no * args.requests
            progress(f"round {round_no + 1}: live tenant alone")
            alone += await live_tenant(client, live_key, args, offset)
            neighbour = Neighbour(client, batch_key, args, round_no)
            await neighbour.start()
            progress(f"round {round_no + 1}: {args.neighbour} neighbour running")
            before, started = await neighbour.count(), time.monotonic()
            busy += await live_tenant(client, live_key, args, offset + args.requests)
            window += time.monotonic() - started
            done += await neighbour.count() - before
            await neighbour.stop()
    return {"alone": alone, "with_batch": busy, "batch_lines_done": done,
            "batch_lines_per_s": done / window, "window_s": window}


def tiny_model(folder: Path) -> Path:
    """A random Llama (4 layers, hidden 256) with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from workers.model_files import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gateway_side(db: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The live tenant's requests as the gateway metered them (arrival to dispatch, and to
    the first token), medians alone and with the neighbour, phase by phase."""
    import sqlite3

    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT queue_ms, ttft_ms FROM usage_records u JOIN tenants t ON t.id = u.tenant_id "
            "WHERE t.name = 'live' ORDER BY u.id").fetchall()[3:]  # the warm-up left out
    n = args.requests
    phases: dict[str, list[tuple[float, float]]] = {"alone": [], "with_batch": []}
    for index in range(0, len(rows), n):
        phases["alone" if (index // n) % 2 == 0 else "with_batch"] += rows[index:index + n]
    return {name: {"queue_p50_ms": statistics.median(r[0] or 0 for r in part),
                   "ttft_p50_ms": statistics.median(r[1] or 0 for r in part)}
            for name, part in phases.items() if part}


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=DEFAULTS["lines"])
    p.add_argument("--requests", type=int, default=DEFAULTS["requests"])
    p.add_argument("--think-s", type=float, default=DEFAULTS["think_s"])
    p.add_argument("--live-max-tokens", type=int, default=DEFAULTS["live_max_tokens"])
    p.add_argument("--batch-max-tokens", type=int, default=DEFAULTS["batch_max_tokens"])
    p.add_argument("--model", default=DEFAULTS["model"],
                   help="the embedded model: default (SmolLM2) or a folder")
    p.add_argument("--batch-concurrency", type=int, default=None)
    p.add_argument("--under-load", type=int, default=None)
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"],
                   help="rounds of (alone, with the batch): drift falls on both")
    p.add_argument("--neighbour", choices=("batch", "live"), default="batch",
                   help="live: the other tenant sends the lines as live requests, one at a "
                        "time (the comparison)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        env = gateway_env(tmp)
        model = str(tiny_model(tmp / "tiny")) if args.model == "tiny" else args.model
        env.update({"SWITCHBOARD_EMBEDDED__MODEL": model,
                    "SWITCHBOARD_EMBEDDED__NAME": MODEL,
                    "SWITCHBOARD_EMBEDDING_MODEL": "none",
                    "SWITCHBOARD_FILES_DIR": str(tmp / "files"),
                    "SWITCHBOARD_MAX_FILE_BYTES": str(1 << 30)})
        if args.batch_concurrency is not None:
            env["SWITCHBOARD_BATCH_MAX_CONCURRENCY"] = str(args.batch_concurrency)
        if args.under_load is not None:
            env["SWITCHBOARD_BATCH_CONCURRENCY_UNDER_LOAD"] = str(args.under_load)
        (tmp / "deployments.yaml").write_text("deployments: []\n")
        gateway_cli(["migrate"], env)
        keys = {}
        for name in ("live", "batch"):
            gateway_cli(["plans", "create", "--name", name, "--rpm", "100000"], env)
            tenant = gateway_cli(["tenants", "create", "--name", name, "--plan", name], env)
            keys[name] = gateway_cli(["keys", "create", "--tenant", str(tenant["id"])],
                                     env)["key"]
        port = free_port()
        server = ServerProcess("gateway", [python(), "-m", "gateway.cli", "serve", "--host",
                                           "127.0.0.1", "--port", str(port)], port,
                               tmp / "serve.log", env=env, cwd=ROOT).start()
        try:
            server.wait_ready("/health", 240)
            result = asyncio.run(measure(server.url, keys["live"], keys["batch"], args))
        finally:
            server.stop()
        result["gateway_side"] = gateway_side(tmp / "gw.db", args)
    alone, busy = summary(result["alone"]), summary(result["with_batch"])
    ratio = busy["p99_ms"] / alone["p99_ms"]
    standard = all(getattr(args, k) == v for k, v in DEFAULTS.items())
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("batch_priority-cpu.json" if standard else "batch_priority-cpu-smoke.json")
    out.write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "machine": cpu_model(),
        "command": " ".join(sys.argv), "alone": alone, "with_batch": busy,
        "p99_ratio": ratio, "batch_lines_done": result["batch_lines_done"],
        "batch_lines_per_s": result["batch_lines_per_s"], "window_s": result["window_s"],
        "gateway_side": result["gateway_side"], "neighbour": args.neighbour,
        "alone_ms": [round(t, 1) for t in result["alone"]],
        "with_batch_ms": [round(t, 1) for t in result["with_batch"]]}, indent=2))
    print(f"\nlive tenant: {args.rounds} x {args.requests} streamed chats "
          f"({args.live_max_tokens} tokens) alone and as many with the other tenant's "
          f"{args.neighbour} ({args.lines} lines of {args.batch_max_tokens} tokens), one at a "
          f"time; {cpu_model()}")
    print("| live tenant TTFT | p50 | p90 | p99 | max | n |")
    print("|---|---|---|---|---|---|")
    for name, s in (("alone", alone), (f"with the {args.neighbour} running", busy)):
        print(f"| {name} | {s['p50_ms']:.1f} ms | {s['p90_ms']:.1f} ms | {s['p99_ms']:.1f} ms "
              f"| {s['max_ms']:.1f} ms | {s['n']} |")
    print(f"gateway-side (usage records): {result['gateway_side']}")
    print(f"p99 with / without: {ratio:.2f}x; batch lines answered meanwhile: "
          f"{result['batch_lines_done']} ({result['batch_lines_per_s']:.2f}/s over "
          f"{result['window_s']:.0f} s)")


if __name__ == "__main__":
    main()
