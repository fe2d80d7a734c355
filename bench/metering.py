"""What metering costs a request: the synchronous part on the request path (the outbox append
in `UsageMeter.record`) and the background part (batched, idempotent database writes with
the daily aggregates), per record.

    .venv/bin/python bench/metering.py                 # SQLite and PostgreSQL
    .venv/bin/python bench/metering.py --records 5000  # quicker

Only `record()` runs before a response's last byte; the database write runs later on the same
event loop, so its CPU time per record is what it takes from the gateway's throughput. Target
(billing issue): metering adds at most 0.5 ms p50 to the gateway's overhead. Writes
`bench/results/metering.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model  # noqa: E402
from billing.meter import UsageMeter  # noqa: E402
from tenancy.db import make_engine, make_sessionmaker  # noqa: E402
from tests.dbutil import migrated_database  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGET_MS = 0.5


def record(i: int) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC)
    return {"request_id": f"bench-{i:08d}-{time.time_ns()}", "tenant_id": f"t{i % 50:02d}",
            "key_id": "k" * 12, "model": "smollm2-135m-instruct", "deployment": "embedded",
            "adapter": "", "tier": "economy", "prompt_tokens": 420, "completion_tokens": 87,
            "cached_tokens": 256, "input_cost_micros": 9, "output_cost_micros": 9,
            "cached_cost_micros": 7, "cost_micros": 25, "price_id": "p" * 32, "status": "ok",
            "cache_hit": "none", "queue_ms": 0.41, "ttft_ms": 35.2, "total_ms": 812.5,
            "started_at": now, "created_at": now}


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5), 2), "p99": round(pick(0.99), 2),
            "mean": round(statistics.fmean(ordered), 2)}


async def measure(backend: str, records: int, tmp: Path) -> dict[str, Any]:
    async with migrated_database(backend, tmp) as url:
        engine = make_engine(url)
        meter = UsageMeter(make_sessionmaker(engine), flush_interval_s=3600,
                           outbox_dir=tmp / f"outbox-{backend}")
        await meter.start()
        try:
            timings = []
            for i in range(records):
                item = record(i)
                t0 = time.perf_counter()
                meter.record(**item)
                timings.append((time.perf_counter() - t0) * 1e6)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            written = await meter.flush()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        finally:
            await meter.stop()
            await engine.dispose()
    return {"backend": backend, "records": records, "written": written,
            "record_us": percentiles(timings),
            "flush_cpu_ms_per_record": round(cpu * 1000 / max(written, 1), 4),
            "flush_wall_ms_per_record": round(wall * 1000 / max(written, 1), 4)}


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--out", type=Path, default=RESULTS / "metering.json")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="metering-") as tmp:
        for backend in args.backends.split(","):
            row = await measure(backend, args.records, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    added = max(r["record_us"]["p50"] for r in rows) / 1000 + max(
        r["flush_cpu_ms_per_record"] for r in rows)
    result = {"benchmark": "metering", "date": dt.datetime.now(dt.UTC).isoformat(
        timespec="seconds"), "command": "bench/metering.py " + " ".join(argv or sys.argv[1:]),
        "cpu": cpu_model(), "results": rows,
        "added_per_request_ms_upper_bound": round(added, 4), "target_ms": TARGET_MS,
        "met": added <= TARGET_MS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"added per request (record p50 + flush CPU per record): {added:.4f} ms "
          f"(target {TARGET_MS} ms); wrote {args.out}")
    return result


if __name__ == "__main__":
    asyncio.run(main())
