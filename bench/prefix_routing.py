"""Prefix-aware routing against least-loaded routing: two SmolLM2 workers, multi-turn chats.

Each configuration gets a fresh gateway and two fresh workers (empty prefix caches), all on
loopback, registered in Redis. `--conversations` chats (each with its own ~300-token system
prompt) run `--turns` turns each, `--concurrency` chats at a time; every turn resends the
whole conversation plus a new question (as chat clients do) and streams a `--max-tokens`
answer, then its user thinks for a random while (`--think-s`, exponential, seeded per chat)
before the next turn, so turns reach the gateway in no fixed order (in lockstep, least-loaded
routing keeps sending a chat to the same worker by accident). Reported per configuration:
TTFT p50/p99 over all turns, and the prompt tokens the workers computed (queried minus
prefix-cache hits, from their /stats). Target: prefix-aware computes at least 2x fewer prompt
tokens, with a lower TTFT p50.

    .venv/bin/python bench/prefix_routing.py [--conversations 8] [--turns 4]

Needs Redis on 127.0.0.1:6379. Results go to bench/results/prefix_routing.json.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common.gateway_procs import ServerProcess, http_request  # noqa: E402
from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from bench.worker_fleet import (  # noqa: E402
    SECRET,
    deployments,
    percentile,
    start_gateway,
    start_worker,
)

WORDS = ("tea", "leaf", "harbour", "river", "market", "ledger", "lantern", "copper", "garden",
         "winter", "north", "steam", "merchant", "spice", "ship", "archive", "letter", "season",
         "mountain", "valley", "bridge", "quiet")


def system_prompt(rng: random.Random) -> str:
    return "You are a patient archivist. Notes: " + " ".join(rng.choice(WORDS)
                                                             for _ in range(260))


def stream_ttft(port: int, key: str, messages: list[dict[str, str]], max_tokens: int
                ) -> tuple[float, str, str]:
    """One streamed chat through the gateway: (seconds to the first content, the text, the
    deployment that served it)."""
    body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {
        "Content-Type": "application/json", "Authorization": f"Bearer {key}",
        "x-switchboard-cache": "off"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}: {resp.read()[:300]!r}")
    served_by = resp.getheader("x-switchboard-deployment", "")
    first, text = None, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        delta = json.loads(line[5:])["choices"]
        piece = delta[0]["delta"].get("content") if delta else None
        if piece:
            if first is None:
                first = time.perf_counter() - started
            text.append(piece)
    conn.close()
    assert first is not None, "no content came back"
    return first, "".join(text), served_by


def computed_tokens(workers: list[ServerProcess]) -> list[int]:
    """Per worker, the prompt tokens it computed so far (looked up minus found cached)."""
    each = []
    for w in workers:
        _, _, body = http_request("GET", f"{w.url}/stats",
                                  headers={"Authorization": f"Bearer {SECRET}"})
        stats = json.loads(body)["stats"]
        each.append(stats["prefix_cache_queried_tokens"] - stats["prefix_cache_hit_tokens"])
    return each


def conversation(port: int, key: str, seed: int, turns: int, max_tokens: int,
                 think_s: float = 0.0) -> list[tuple[float, str]]:
    """The chat's turns as (TTFT, the deployment that served it)."""
    rng = random.Random(seed)
    think = random.Random(seed + 1_000_003)  # its own stream: the texts stay the same
    messages = [{"role": "system", "content": system_prompt(rng)}]
    ttfts = []
    for turn in range(turns):
        question = f"Question {turn}: what about the " + " ".join(rng.choice(WORDS)
                                                                 for _ in range(20)) + "?"
        messages.append({"role": "user", "content": question})
        ttft, answer, served_by = stream_ttft(port, key, messages, max_tokens)
        ttfts.append((ttft, served_by))
        messages.append({"role": "assistant", "content": answer})
        if think_s > 0 and turn + 1 < turns:
            time.sleep(think.expovariate(1 / think_s))
    return ttfts


def wait_discovered(gateway: ServerProcess, n: int, timeout_s: float = 60.0) -> None:
    """Until the gateway has found all `n` workers in Redis: a chat sent before then would
    see a smaller pool (or none, a 404)."""
    deadline = time.monotonic() + timeout_s
    while sum(name.startswith("pool@") for name in deployments(gateway)) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway found fewer than {n} workers in {timeout_s:.0f} s")
        time.sleep(0.2)


def run(config: str, args: argparse.Namespace, tokenizer: str) -> dict[str, Any]:
    served = f"smollm2-prefix-{uuid.uuid4().hex[:6]}"
    procs: list[ServerProcess] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            hot = ["--prefix-hot-window-s", str(args.hot_window_s)]
            workers = [start_worker(tmp, served, f"{served}-{i}", args.kv_cache_mib, hot)
                       for i in "ab"]
            procs += workers
            pool = {"prefix_tokenizer": tokenizer,
                    "prefix_load_penalty_tokens": args.penalty_tokens
                    } if config == "prefix-aware" else {}
            gateway, key = start_gateway(tmp, served, **pool)
            procs.append(gateway)
            wait_discovered(gateway, len(workers))
            before = computed_tokens(workers)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as ex:
                chats = list(ex.map(
                    lambda seed: conversation(gateway.port, key, seed, args.turns,
                                              args.max_tokens, args.think_s),
                    range(args.conversations)))
            wall = time.perf_counter() - t0
            time.sleep(0.2)
            computed = [a - b for a, b in zip(computed_tokens(workers), before, strict=True)]
        except RuntimeError:
            for p in procs:
                print(f"--- {p.name} log ---\n{p.log_tail()}", file=sys.stderr)
            raise
        finally:
            for p in procs:
                p.stop()
    ttfts = [t for chat in chats for t, _ in chat]
    # follow-ups served by another worker than the chat's turn before
    moves = sum(a != b for chat in chats for (_, a), (_, b) in itertools.pairwise(chat))
    first_turns = [chat[0][1] for chat in chats if chat]
    chats_by_worker = {w: first_turns.count(w) for w in sorted(set(first_turns))}
    return {"config": config, "turns": len(ttfts), "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": percentile(ttfts, 0.99), "prompt_tokens_computed": sum(computed),
            "computed_per_worker": computed, "follow_ups_moved": moves,
            "first_turns_per_worker": chats_by_worker, "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--penalty-tokens", type=int, default=256,
                        help="the pool's prefix_load_penalty_tokens (cached tokens per unit "
                             "of load)")
    parser.add_argument("--kv-cache-mib", type=int, default=256,
                        help="each worker's KV pool (SmolLM2 float32: 45 KiB a token)")
    parser.add_argument("--think-s", type=float, default=1.0,
                        help="mean pause between a chat's turns (exponential; 0: none)")
    parser.add_argument("--hot-window-s", type=float, default=10.0,
                        help="the workers' --prefix-hot-window-s: a few times --think-s, so a "
                             "chat between turns counts toward its worker's KV working set")
    parser.add_argument("--routings", default="least-loaded,prefix-aware",
                        help="which routings to run, in order (the ratio is to the first)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" /
                        "prefix_routing.json")
    args = parser.parse_args(argv)
    from workers.model_files import resolve_model

    tokenizer = str(resolve_model(None))
    rows = [run(config, args, tokenizer) for config in args.routings.split(",")]
    result = {"machine": cpu_model(), "simd": simd_flags(), "cpus": os.cpu_count(),
              "command": " ".join(sys.argv), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    base = rows[0]
    print(f"\n{cpu_model()}; {args.conversations} chats x {args.turns} turns, "
          f"{args.concurrency} at a time, think {args.think_s} s, 2 SmolLM2 workers with "
          f"{args.kv_cache_mib} MiB of KV each")
    print("| routing | TTFT p50 | TTFT p99 | prompt tokens computed (per worker) | "
          f"vs {base['config']} | follow-ups moved | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['ttft_p50_s'] * 1000:.0f} ms "
              f"| {r['ttft_p99_s'] * 1000:.0f} ms | {r['prompt_tokens_computed']} "
              f"({' + '.join(map(str, r['computed_per_worker']))}) "
              f"| {base['prompt_tokens_computed'] / max(r['prompt_tokens_computed'], 1):.2f}x "
              f"fewer | {r['follow_ups_moved']} | {r['wall_s']:.1f} s |")


if __name__ == "__main__":
    main()
