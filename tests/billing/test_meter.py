"""The usage meter writes batches off the hot path, and one bad record never blocks the rest."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import select

from billing.meter import UsageMeter
from tenancy.db import make_engine, make_sessionmaker
from tenancy.models import UsageRecord
from tests.dbutil import BACKENDS, migrated_database


@pytest.fixture(params=BACKENDS)
async def sessionmaker(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator:
    async with migrated_database(request.param, tmp_path) as url:
        engine = make_engine(url)
        yield make_sessionmaker(engine)
        await engine.dispose()


def record(request_id: str, **overrides: object) -> dict[str, object]:
    return {"request_id": request_id, "tenant_id": "t1", "key_id": "k1", "model": "m",
            "deployment": "d", "prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 0,
            "cost_micros": 11, "status": "ok", **overrides}


async def test_batches_and_skips_a_refused_record(sessionmaker):
    meter = UsageMeter(sessionmaker, flush_interval_s=60)
    meter.record(**record("a"))
    meter.record(**record("bad", tenant_id=None))  # NOT NULL: the database refuses it
    meter.record(**record("c"))
    assert await meter.flush() == 3
    assert await meter.flush() == 0  # nothing left pending, nothing retried forever
    async with sessionmaker() as session:
        ids = (await session.scalars(select(UsageRecord.request_id))).all()
    assert sorted(ids) == ["a", "c"]


async def test_stop_flushes_what_is_pending(sessionmaker):
    meter = UsageMeter(sessionmaker, flush_interval_s=60)
    await meter.start()
    meter.record(**record("x"))
    await meter.stop()
    async with sessionmaker() as session:
        assert (await session.scalars(select(UsageRecord.request_id))).all() == ["x"]
