"""The audit of issue 40, replayed on the default serve: do limits, budgets and embeddings keep
their promises?

`switchboard serve` on the embedded default (SmolLM2 and the embedding model, SQLite) in its
own process. Bursts of `--burst` concurrent chats whose prompts are 400 emoji (three tokens
each) or 400 digits (a token each, where a cheap estimate guesses four a token), against a
plan with TPM 2,000, then against a plan with a 200 micro-USD budget; what the usage ledger
metered for each. Then the largest embeddings request the audit sent (2,048 inputs of 254
token ids) and, while a large allowed one runs, another tenant's one-string request.

Usage: .venv/bin/python bench/promises.py [--burst 30]
Prints a table last and writes bench/results/promises-cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sqlite3
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
from bench.common.machine import cpu_model, simd_flags  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = {"emoji": "😀" * 400, "digits": "0123456789" * 40}
TPM = 2000
BUDGET_USD = "0.0002"  # 200 micro-USD


def tenant(env: dict[str, str], name: str, *plan: str) -> str:
    gateway_cli(["plans", "create", "--name", name, *plan], env)
    made = gateway_cli(["tenants", "create", "--name", name, "--plan", name], env)
    return gateway_cli(["keys", "create", "--tenant", str(made["id"])], env)["key"]


def metered(db: Path, tenant_key: str) -> dict[str, int]:
    """What the ledger holds for the tenant of this key (by its key id)."""
    key_id = tenant_key.split("-")[2]
    with sqlite3.connect(db) as conn:
        rows, tokens, cost = conn.execute(
            "select count(*), coalesce(sum(prompt_tokens + completion_tokens), 0), "
            "coalesce(sum(cost_micros), 0) from usage_records where key_id = ?",
            (key_id,)).fetchone()
    return {"records": rows, "tokens": tokens, "cost_micros": cost}


async def burst(url: str, key: str, prompt: str, n: int) -> dict[str, int]:
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 headers={"authorization": f"Bearer {key}"}) as client:
        async def one() -> int:
            r = await client.post("/v1/chat/completions", json={
                "model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]},
                headers={"x-switchboard-cache": "off"})
            return r.status_code
        statuses = await asyncio.gather(*(one() for _ in range(n)))
    return {str(s): statuses.count(s) for s in sorted(set(statuses))}


async def embeddings(url: str, big_key: str, small_key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        largest = [[100 + (i + j) % 1000 for j in range(254)] for i in range(2048)]
        start = time.perf_counter()
        r = await client.post("/v1/embeddings", json={"model": "all-minilm-l6-v2",
                                                      "input": largest},
                              headers={"authorization": f"Bearer {big_key}"})
        out["largest"] = {"status": r.status_code, "seconds": round(time.perf_counter() - start, 3),
                          "code": (r.json().get("error") or {}).get("code")
                          if r.status_code >= 400 else None}
        alone_start = time.perf_counter()
        await client.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "hi"},
                          headers={"authorization": f"Bearer {small_key}"})
        out["small_alone_s"] = round(time.perf_counter() - alone_start, 3)
        allowed = [[100 + (i + j) % 1000 for j in range(254)] for i in range(500)]
        big = asyncio.create_task(client.post(
            "/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": allowed},
            headers={"authorization": f"Bearer {big_key}"}))
        await asyncio.sleep(1.0)  # the large one is computing
        small_start = time.perf_counter()
        small = await client.post("/v1/embeddings", json={"model": "all-minilm-l6-v2",
                                                          "input": "hi"},
                                  headers={"authorization": f"Bearer {small_key}"})
        out["small_while_large_s"] = round(time.perf_counter() - small_start, 3)
        out["small_status"] = small.status_code
        large = await big
        out["large_allowed"] = {"status": large.status_code,
                                "seconds": round(time.perf_counter() - small_start + 1.0, 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--burst", type=int, default=30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        env = gateway_env(tmp)
        env["SWITCHBOARD_EMBEDDED__MODEL"] = "default"
        env["SWITCHBOARD_EMBEDDING_MODEL"] = "default"
        (tmp / "deployments.yaml").write_text("deployments: []\n")
        gateway_cli(["migrate"], env)
        keys = {}
        for alphabet in PROMPTS:
            keys[f"tpm-{alphabet}"] = tenant(env, f"tpm-{alphabet}", "--tpm", str(TPM))
            keys[f"budget-{alphabet}"] = tenant(env, f"budget-{alphabet}", "--budget-usd",
                                                BUDGET_USD)
        keys["embed-big"] = tenant(env, "embed-big")
        keys["embed-small"] = tenant(env, "embed-small")
        port = free_port()
        server = ServerProcess("gateway", [python(), "-m", "gateway.cli", "serve", "--host",
                                           "127.0.0.1", "--port", str(port)], port,
                               tmp / "serve.log", env=env, cwd=ROOT).start()
        rows = []
        try:
            server.wait_ready("/health", 300)
            for alphabet, prompt in PROMPTS.items():
                for kind in ("tpm", "budget"):
                    key = keys[f"{kind}-{alphabet}"]
                    statuses = asyncio.run(burst(server.url, key, prompt, args.burst))
                    time.sleep(2.0)  # the meter flushes every 0.5 s
                    rows.append({"limit": kind, "alphabet": alphabet, "statuses": statuses,
                                 **metered(tmp / "gw.db", key)})
            embedding = asyncio.run(embeddings(server.url, keys["embed-big"],
                                               keys["embed-small"]))
            time.sleep(2.0)
            embedding["big_tenant_metered"] = metered(tmp / "gw.db", keys["embed-big"])
        finally:
            server.stop()
    RESULTS.mkdir(exist_ok=True)
    machine = {"cpu": cpu_model(), "simd": simd_flags()}
    (RESULTS / "promises-cpu.json").write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "machine": machine,
        "command": " ".join(sys.argv), "burst": args.burst, "tpm": TPM,
        "budget_micros": 200, "rows": rows, "embeddings": embedding}, indent=2))
    print(f"\n{args.burst} concurrent chats, max_tokens 16; {machine['cpu']}")
    print("| plan | prompt | answers | metered tokens | metered micro-USD |")
    print("|---|---|---|---|---|")
    for r in rows:
        plan = f"TPM {TPM}" if r["limit"] == "tpm" else "budget 200 micro-USD"
        print(f"| {plan} | 400 {r['alphabet']} | {r['statuses']} | {r['tokens']} "
              f"| {r['cost_micros']} |")
    print(f"\nembeddings: {json.dumps(embedding)}")


if __name__ == "__main__":
    main()
