"""How long the console's usage page takes over a busy ledger: 13,500 daily aggregate rows
(50 tenants x 90 days x 3 models), on SQLite and PostgreSQL, in process (no network).

    .venv/bin/python bench/console_usage.py

The page reads only the aggregates (three grouped queries and the tenant list), so its cost
follows the number of tenants and days shown, not the number of requests behind them.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sqlalchemy import insert  # noqa: E402

from billing.models import UsageDaily  # noqa: E402
from tenancy import service  # noqa: E402
from tenancy.db import make_engine, make_sessionmaker  # noqa: E402
from tests.dbutil import migrated_database  # noqa: E402
from tests.gateway.console.support import console  # noqa: E402

TENANTS, DAYS, MODELS, ROUNDS = 50, 90, 3, 12


def aggregate_rows(tenants: list[str]) -> list[dict[str, Any]]:
    today = date.today()
    sums = {"requests": 10, "errors": 1, "cache_hits": 2, "prompt_tokens": 1000,
            "completion_tokens": 200, "cached_tokens": 100, "input_cost_micros": 5,
            "output_cost_micros": 6, "cached_cost_micros": 1, "cost_micros": 12}
    return [{"tenant_id": t, "day": today - timedelta(days=d), "model": f"m{m}",
             "deployment": "d", "tier": "standard", "adapter": "", **sums}
            for t in tenants for d in range(DAYS) for m in range(MODELS)]


async def measure(backend: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="console-usage-"))
    async with migrated_database(backend, tmp) as url:
        engine = make_engine(url)
        async with make_sessionmaker(engine)() as session:
            plan = await service.create_plan(session, name="bench")
            tenants = [(await service.create_tenant(session, name=f"t{i}", plan_id=plan.id)).id
                       for i in range(TENANTS)]
            rows = aggregate_rows(tenants)
            for start in range(0, len(rows), 1000):
                await session.execute(insert(UsageDaily), rows[start:start + 1000])
            await session.commit()
        await engine.dispose()
        async with console(url, tmp) as c:
            times = []
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                response = await c.client.get("/console/usage")
                assert response.status_code == 200, response.status_code
                times.append((time.perf_counter() - t0) * 1000)
    times = sorted(times[2:])  # the first two warm caches up
    print(f"{backend}: usage page over {len(rows)} aggregate rows: "
          f"p50 {times[len(times) // 2]:.1f} ms, max {times[-1]:.1f} ms")


if __name__ == "__main__":
    for name in ("sqlite", "postgres"):
        asyncio.run(measure(name))
