"""Redis server CPU and client time per admit + settle of the Redis limiter (docs/scaling.md).

Server time comes from Redis's own INFO commandstats (script calls), client CPU from this
process. Keys live under a fresh namespace that is deleted afterwards.

    .venv/bin/python bench/archive/redis_limiter_cost.py [--requests 20000] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tenancy.limits import RedisLimiter  # noqa: E402
from tenancy.limits.types import AdmissionRequest, Budget, Limits  # noqa: E402

URL = "redis://127.0.0.1:6379/0"
SCRIPT_COMMANDS = ("cmdstat_evalsha", "cmdstat_eval")


def script_stats(client: redis.Redis) -> tuple[int, int]:
    """(calls, microseconds) of script commands so far."""
    stats = client.info("commandstats")
    return (sum(stats[k]["calls"] for k in SCRIPT_COMMANDS if k in stats),
            sum(stats[k]["usec"] for k in SCRIPT_COMMANDS if k in stats))


async def run(requests: int, concurrency: int) -> None:
    namespace = f"bench-{uuid.uuid4().hex[:6]}:"
    limiter = RedisLimiter(URL, fail_open=False, timeout_s=2, namespace=namespace)
    sync = redis.Redis.from_url(URL)
    gate = asyncio.Semaphore(concurrency)
    big = Limits(rpm=10**7, tpm=10**9, max_concurrent=10**5)

    async def one(i: int) -> None:
        tenant = f"t{i % 50}"
        request = AdmissionRequest(
            request_id=uuid.uuid4().hex,
            scopes=((f"key:{tenant}k", big), (f"tenant:{tenant}", big)),
            tokens=300, cost_micros=100,
            budget=Budget(f"tenant:{tenant}", 10**12, "2026-11", 86400))
        async with gate:
            decision = await limiter.admit(request)
            assert decision.admitted, decision
            await limiter.settle(request, tokens=250, cost_micros=80)

    try:
        await asyncio.gather(*(one(i) for i in range(500)))  # warm up
        calls0, usec0 = script_stats(sync)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        calls1, usec1 = script_stats(sync)
        calls, usec = calls1 - calls0, usec1 - usec0
        print(f"requests={requests} wall={wall:.2f}s req/s={requests / wall:.0f} "
              f"script calls={calls} server usec/call={usec / max(calls, 1):.1f} "
              f"server usec/request={usec / requests:.1f} "
              f"client cpu usec/request={cpu / requests * 1e6:.0f}")
    finally:
        await limiter.close()
        for key in sync.scan_iter(match=namespace + "*", count=1000):
            sync.delete(key)
        sync.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    asyncio.run(run(args.requests, args.concurrency))


if __name__ == "__main__":
    main()
