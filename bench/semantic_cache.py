"""Semantic cache: lookup latency with 100k entries in one tenant and scope, and the threshold.

One tenant, one scope, `--entries` entries: random unit vectors (the index's load) plus the
labelled questions of tests/caching/data. Lookups are timed without embedding:

- paraphrase: the labelled `b` questions, with their text (the guard runs on matches)
- near: stored random vectors moved to cosine 0.9 (hits)
- miss: fresh random unit vectors (nothing above the threshold)

The in-process backend is timed as is. The Redis backend is filled by one replica and timed on
another, fresh one (its first lookup loads the tenant; that load is timed separately), so every
timed lookup includes its log sync round trip and, on a hit, the value fetch. The embedder is
timed separately, one question per call as the gateway calls it. Precision and recall at
DEFAULT_THRESHOLD come from the labelled sets, one scope per pair.

Usage: .venv/bin/python bench/semantic_cache.py [--entries 100000] [--backend memory|redis|both]
       [--queries 1000] [--out bench/results/semantic_cache.json]
Redis traffic goes only to --redis-url (default 127.0.0.1:6379), under a fresh key prefix that
is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `caching` and `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model  # noqa: E402
from caching.embedder import Embedder  # noqa: E402
from caching.semantic import (  # noqa: E402
    DEFAULT_THRESHOLD,
    MemorySemanticCache,
    RedisSemanticCache,
    SemanticCache,
)

DATA = ROOT / "tests" / "caching" / "data"
SETS = ("paraphrases.jsonl", "paraphrases_holdout.jsonl")
RESULTS = ROOT / "bench" / "results"
TENANT, SCOPE = "bench-tenant", "bench-scope"
TABLE_THRESHOLDS = (0.70, 0.75, 0.78, 0.80, 0.82, 0.85, 0.88, 0.90)


def pairs(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.asarray(samples_s) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p90_ms": round(float(np.percentile(ms, 90)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "n": len(samples_s)}


def random_units(n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def near_copies(x: np.ndarray, cos: float, rng: np.random.Generator) -> np.ndarray:
    z = rng.standard_normal(x.shape, dtype=np.float32)
    z -= (z * x).sum(1, keepdims=True) * x
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return (cos * x + np.sqrt(1 - cos * cos) * z).astype(np.float32)


class Workload:
    """What is stored and what is looked up, the same for every backend."""

    def __init__(self, entries: int, queries: int, embedder: Embedder, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.labelled = [row for name in SETS for row in pairs(name)]
        questions = embedder.embed_sync([r["a"] for r in self.labelled]
                                        + [r["b"] for r in self.labelled])
        count = len(self.labelled)
        self.a_vectors, self.b_vectors = questions[:count], questions[count:]
        randoms = random_units(max(0, entries - count), embedder.dim, rng)
        self.vectors = np.concatenate([self.a_vectors, randoms])
        self.texts: list[str | None] = [r["a"] for r in self.labelled] + [None] * len(randoms)
        picked = rng.choice(np.arange(count, len(self.vectors)), size=queries, replace=False)
        self.lookups: list[tuple[str, np.ndarray, str | None]] = [
            *(("paraphrase", self.b_vectors[i], r["b"]) for i, r in enumerate(self.labelled)),
            *(("near", v, None) for v in near_copies(self.vectors[picked], 0.9, rng)),
            *(("miss", v, None) for v in random_units(queries, embedder.dim, rng)),
        ]
        order = rng.permutation(len(self.lookups))
        self.lookups = [self.lookups[i] for i in order]

    def __len__(self) -> int:
        return len(self.vectors)


async def fill(cache: SemanticCache, work: Workload, *, concurrency: int) -> float:
    """Store every entry; returns seconds taken."""
    start = time.perf_counter()
    for first in range(0, len(work), concurrency):
        batch = range(first, min(first + concurrency, len(work)))
        await asyncio.gather(*[
            cache.store(TENANT, SCOPE, work.vectors[i], f"answer {i}".encode(), ttl_s=3600,
                        text=work.texts[i]) for i in batch])
    return time.perf_counter() - start


async def time_lookups(cache: SemanticCache, work: Workload) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = {"paraphrase": [], "near": [], "miss": []}
    hits = dict.fromkeys(by_kind, 0)
    for kind, vector, text in work.lookups:
        start = time.perf_counter()
        hit = await cache.lookup(TENANT, SCOPE, vector, threshold=DEFAULT_THRESHOLD, text=text)
        by_kind[kind].append(time.perf_counter() - start)
        hits[kind] += hit is not None
    everything = [s for samples in by_kind.values() for s in samples]
    return {"all": percentiles(everything),
            **{kind: {**percentiles(samples), "hits": hits[kind]}
               for kind, samples in by_kind.items()}}


async def bench_memory(work: Workload) -> dict[str, Any]:
    cache = MemorySemanticCache(max_entries_per_tenant=len(work) + 1)
    fill_s = await fill(cache, work, concurrency=1000)
    await time_lookups(cache, work)  # warm-up: builds the Hamming index, warms caches
    result = {"fill_s": round(fill_s, 2), "lookup": await time_lookups(cache, work)}
    await cache.close()
    return result


async def bench_redis(work: Workload, redis_url: str) -> dict[str, Any]:
    from redis.asyncio import from_url

    client = from_url(redis_url, socket_timeout=30, socket_connect_timeout=2)
    prefix = f"sbbench:{uuid.uuid4().hex[:12]}"
    try:
        writer = RedisSemanticCache(client, prefix=prefix, max_entries_per_tenant=len(work) + 1)
        fill_s = await fill(writer, work, concurrency=64)
        reader = RedisSemanticCache(client, prefix=prefix, max_entries_per_tenant=len(work) + 1)
        start = time.perf_counter()
        await reader.sync(TENANT)
        load_s = time.perf_counter() - start
        assert reader.indexed(TENANT) == len(work), "the replica did not load every entry"
        await time_lookups(reader, work)  # warm-up, as for memory
        lookup = await time_lookups(reader, work)
        await writer.close()
        await reader.close()
        return {"fill_s": round(fill_s, 2), "replica_first_load_s": round(load_s, 2),
                "lookup": lookup}
    finally:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        for first in range(0, len(keys), 1000):
            await client.delete(*keys[first:first + 1000])
        await client.aclose()


def brute_force(work: Workload, queries: int = 200) -> dict[str, float]:
    """numpy over every row, for comparison: what the index saves."""
    samples = []
    for _, vector, _ in work.lookups[:queries]:
        start = time.perf_counter()
        int(np.argmax(work.vectors @ vector))
        samples.append(time.perf_counter() - start)
    return percentiles(samples)


async def bench_embedder(embedder: Embedder, texts: list[str]) -> dict[str, float]:
    await embedder.embed(texts[0])  # the worker thread starts
    samples = []
    for text in texts:
        start = time.perf_counter()
        await embedder.embed(text)
        samples.append(time.perf_counter() - start)
    return percentiles(samples)


async def labelled_scores(embedder: Embedder) -> dict[str, Any]:
    """Precision and recall per set, with and without the guard, around the threshold."""
    out: dict[str, Any] = {}
    for name in SETS:
        rows = pairs(name)
        vectors = embedder.embed_sync([r["a"] for r in rows] + [r["b"] for r in rows])
        table = []
        for threshold in sorted({*TABLE_THRESHOLDS, DEFAULT_THRESHOLD}):
            for guarded in (True, False):
                cache = MemorySemanticCache()
                tp = fp = 0
                for i, row in enumerate(rows):
                    await cache.store("t", f"pair{i}", vectors[i], b"a", ttl_s=60,
                                      text=row["a"] if guarded else None)
                    hit = await cache.lookup("t", f"pair{i}", vectors[len(rows) + i],
                                             threshold=threshold,
                                             text=row["b"] if guarded else None)
                    tp += hit is not None and row["same"]
                    fp += hit is not None and not row["same"]
                positives = sum(r["same"] for r in rows)
                table.append({"threshold": threshold, "guard": guarded, "served_right": tp,
                              "served_wrong": fp,
                              "precision": round(tp / (tp + fp), 3) if tp + fp else None,
                              "recall": round(tp / positives, 3)})
        at_default = [r for r in table if r["threshold"] == DEFAULT_THRESHOLD]
        out[name] = {"pairs": len(rows), "positives": sum(r["same"] for r in rows),
                     "at_default": at_default, "table": table}
    out["one_scope"] = await one_scope(embedder)
    return out


async def one_scope(embedder: Embedder) -> dict[str, int]:
    """Every labelled `a` in one scope, every `b` looked up (guarded): what got served, and
    how often it was not the pair's own paraphrase (a wrong answer)."""
    rows = [row for name in SETS for row in pairs(name)]
    vectors = embedder.embed_sync([r["a"] for r in rows] + [r["b"] for r in rows])
    cache = MemorySemanticCache()
    stored: set[str] = set()
    for i, row in enumerate(rows):
        if row["a"] not in stored:
            stored.add(row["a"])
            await cache.store("t", "one", vectors[i], row["a"].encode(), ttl_s=60, text=row["a"])
    served = wrong = 0
    for i, row in enumerate(rows):
        hit = await cache.lookup("t", "one", vectors[len(rows) + i],
                                 threshold=DEFAULT_THRESHOLD, text=row["b"])
        served += hit is not None
        wrong += hit is not None and (not row["same"] or hit.value != row["a"].encode())
    return {"entries": len(stored), "lookups": len(rows), "served": served, "wrong": wrong}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=1000, help="near and miss lookups each")
    parser.add_argument("--backend", choices=("memory", "redis", "both"), default="both")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", type=Path, default=RESULTS / "semantic_cache.json")
    args = parser.parse_args()

    embedder = Embedder()
    embedder.load()
    work = Workload(args.entries, args.queries, embedder)
    results: dict[str, Any] = {"threshold": DEFAULT_THRESHOLD, "entries": len(work)}
    results["labelled"] = await labelled_scores(embedder)
    questions = [r["b"] for r in work.labelled][:200]
    results["embed_one_question"] = await bench_embedder(embedder, questions)
    results["numpy_brute_force"] = brute_force(work)
    if args.backend in ("memory", "both"):
        results["memory"] = await bench_memory(work)
    if args.backend in ("redis", "both"):
        results["redis"] = await bench_redis(work, args.redis_url)
    await embedder.close()

    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": cpu_model(),
                    "platform": platform.platform()},
        "command": "bench/semantic_cache.py " + " ".join(sys.argv[1:]),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(results)
    print(f"wrote {args.out}")


def print_summary(results: dict[str, Any]) -> None:
    print(f"threshold {results['threshold']}, {results['entries']} entries in one scope")
    for name in SETS:
        for row in results["labelled"][name]["at_default"]:
            print(f"  {name:28s} guard={row['guard']!s:5s} precision={row['precision']} "
                  f"recall={row['recall']} (right {row['served_right']}, "
                  f"wrong {row['served_wrong']})")
    print("  all labelled questions in one scope:", results["labelled"]["one_scope"])
    embed = results["embed_one_question"]
    print(f"  embed one question: p50 {embed['p50_ms']} ms, p99 {embed['p99_ms']} ms")
    brute = results["numpy_brute_force"]
    print(f"  numpy brute force:  p50 {brute['p50_ms']} ms, p99 {brute['p99_ms']} ms")
    for backend in ("memory", "redis"):
        if backend not in results:
            continue
        lookup = results[backend]["lookup"]
        hits = {k: lookup[k]["hits"] for k in ("paraphrase", "near", "miss")}
        print(f"  {backend:6s} lookup: p50 {lookup['all']['p50_ms']} ms, p90 "
              f"{lookup['all']['p90_ms']} ms, p99 {lookup['all']['p99_ms']} ms; hits {hits}; "
              + ", ".join(f"{k}={v}" for k, v in results[backend].items() if k != "lookup"))


if __name__ == "__main__":
    asyncio.run(main())
