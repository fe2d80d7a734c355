"""One gateway-like process for the cross-process test: fire a burst of admits, print counts.

Usage: python -m tests.tenancy.limits.burst REDIS_URL NAMESPACE WORKER COUNT START_AT
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from tenancy.limits import AdmissionRequest, Limits, RedisLimiter

SCOPES = (("key:shared", Limits(rpm=50)), ("tenant:shared", Limits(rpm=1000, tpm=1_000_000)))


async def main(url: str, namespace: str, worker: str, count: int, start_at: float) -> None:
    limiter = RedisLimiter(url, fail_open=False, timeout_s=5.0, namespace=namespace)
    try:
        await asyncio.sleep(max(start_at - time.time(), 0.0))
        decisions = await asyncio.gather(
            *(
                limiter.admit(AdmissionRequest(f"{worker}-{n}", SCOPES, tokens=10))
                for n in range(count)
            )
        )
    finally:
        await limiter.close()
    reasons: dict[str, int] = {}
    for decision in decisions:
        key = decision.reason or "admitted"
        reasons[key] = reasons.get(key, 0) + 1
    print(json.dumps(reasons))


if __name__ == "__main__":
    url, namespace, worker, count, start_at = sys.argv[1:6]
    asyncio.run(main(url, namespace, worker, int(count), float(start_at)))
