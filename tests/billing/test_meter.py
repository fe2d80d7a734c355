"""The usage meter writes batches off the hot path, one bad record never blocks the rest, and
its outbox makes records survive crashes and database outages, each written exactly once."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from billing.meter import UsageMeter
from billing.models import UsageDaily
from billing.outbox import Outbox
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


async def test_a_batch_lines_mark_survives_the_outbox(sessionmaker, tmp_path):
    """A record's batch id and price share (the request path's ticket fills them for a batch
    line) are written, and kept by what a dead process left in the outbox."""
    meter = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=tmp_path / "outbox")
    meter.record(**record("live"))
    meter.record(**record("line-1"), batch_id="batch_1", batch_price_percent=25)
    assert await meter.flush() == 2
    async with sessionmaker() as session:
        marks = {r.request_id: (r.batch_id, r.batch_price_percent) for r in (
            await session.scalars(select(UsageRecord))).all()}
    assert marks == {"live": (None, None), "line-1": ("batch_1", 25)}
    dead = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=tmp_path / "dead")
    dead.record(**record("line-3", created_at=datetime.now(UTC)), batch_id="batch_2",
                batch_price_percent=50)
    assert dead.outbox is not None and dead.outbox.close() == 1  # never written
    again = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=tmp_path / "dead")
    await again.start()
    await again.stop()
    async with sessionmaker() as session:
        row = await session.scalar(select(UsageRecord).where(UsageRecord.request_id == "line-3"))
    assert row is not None and (row.batch_id, row.batch_price_percent) == ("batch_2", 50)


# -- durable metering: the outbox ------------------------------------------------------------


class Switch:
    """A sessionmaker whose database can be taken away and given back."""

    def __init__(self, up: async_sessionmaker[AsyncSession], down_url: str) -> None:
        self.up = up
        self.engine = make_engine(down_url)
        self.down = make_sessionmaker(self.engine)
        self.available = False

    def __call__(self) -> AsyncSession:
        return (self.up if self.available else self.down)()


def down_url(backend_url: str, tmp_path: Path) -> str:
    if backend_url.startswith("sqlite"):
        return f"sqlite+aiosqlite:///{tmp_path / 'missing-dir' / 'x.db'}"
    return "postgresql+asyncpg://postgres@127.0.0.1:1/nothing"  # connection refused


async def stored(sessionmaker) -> list[str]:
    async with sessionmaker() as session:
        return sorted((await session.scalars(select(UsageRecord.request_id))).all())


async def daily_requests(sessionmaker) -> int:
    async with sessionmaker() as session:
        return int(await session.scalar(select(func.coalesce(func.sum(UsageDaily.requests), 0))))


def crashed_process_outbox(directory: Path, request_ids: list[str]) -> None:
    """Segments as a killed gateway leaves them: written, never committed, unlocked."""
    box = Outbox(directory)
    for request_id in request_ids:
        assert box.append(record(request_id, created_at=datetime.now(UTC))) is not None
    assert box.close() == len(request_ids)


async def test_records_arriving_during_a_write_wait_for_the_next_flush(sessionmaker, tmp_path):
    """A flush writes what was pending when it began, in one batch: under load, records that
    arrive meanwhile must not be chased with back-to-back transactions of one record each."""
    meter = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=tmp_path / "outbox")
    writes: list[int] = []
    write = meter._write

    async def counting(records: list[dict[str, object]]) -> None:
        writes.append(len(records))
        if len(writes) <= 2:
            meter.record(**record(f"late{len(writes)}"))  # a request answered meanwhile
        await write(records)

    meter._write = counting  # type: ignore[method-assign]
    for i in range(3):
        meter.record(**record(f"r{i}"))
    assert await meter.flush() == 3
    assert writes == [3] and meter.pending == 1
    meter._stopping = True  # stopping drains everything, late arrivals included
    assert await meter.flush() == 2
    assert writes == [3, 1, 1] and meter.pending == 0
    assert len(await stored(sessionmaker)) == 5
    meter._write = write  # type: ignore[method-assign]
    await meter.stop()


async def test_outbox_replays_land_exactly_once(sessionmaker, tmp_path):
    outbox = tmp_path / "outbox"
    crashed_process_outbox(outbox, ["a", "b", "c"])
    (segment,) = outbox.iterdir()
    # The same records twice: a segment replayed, committed, then not deleted (a crash).
    shutil.copy(segment, outbox / segment.name.replace("usage-", "usage-9"))
    meter = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=outbox)
    await meter.start()  # replays before serving
    assert await stored(sessionmaker) == ["a", "b", "c"]
    assert list(outbox.iterdir()) == []
    await meter.stop()

    crashed_process_outbox(outbox, ["a", "b", "c", "d"])  # a third replay, and one new
    again = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=outbox)
    await again.start()
    await again.stop()
    assert await stored(sessionmaker) == ["a", "b", "c", "d"]
    assert await daily_requests(sessionmaker) == 4  # aggregates count each once
    assert list(outbox.iterdir()) == []


async def test_flushed_segments_are_deleted_and_stop_leaves_nothing(sessionmaker, tmp_path):
    outbox = tmp_path / "outbox"
    meter = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=outbox)
    await meter.start()
    meter.record(**record("a"))
    assert len(list(outbox.iterdir())) == 1
    assert await meter.flush() == 1
    assert list(outbox.iterdir()) == []  # committed: its segment is gone
    for i in range(5):
        meter.record(**record(f"s{i}"))
    await meter.stop()  # SIGTERM: everything written, the outbox left empty
    assert await stored(sessionmaker) == ["a", *(f"s{i}" for i in range(5))]
    assert list(outbox.iterdir()) == []


async def test_database_down_then_back(sessionmaker, tmp_path):
    outbox = tmp_path / "outbox"
    async with sessionmaker() as session:
        url = session.get_bind().url.render_as_string(hide_password=False)
    switch = Switch(sessionmaker, down_url(url, tmp_path))
    crashed_process_outbox(outbox, ["left"])
    meter = UsageMeter(switch, flush_interval_s=0.05, outbox_dir=outbox)  # type: ignore[arg-type]
    await meter.start()  # the replay fails; the start does not
    for i in range(3):
        meter.record(**record(f"r{i}"))  # never blocks, never raises
    await asyncio.sleep(0.3)  # a few failed background flushes
    assert meter.pending == 3
    assert await stored(sessionmaker) == []
    switch.available = True
    for _ in range(100):
        if len(await stored(sessionmaker)) == 4:
            break
        await asyncio.sleep(0.05)
    assert await stored(sessionmaker) == ["left", "r0", "r1", "r2"]
    switch.available = False
    meter.record(**record("during-stop"))
    await meter.stop()  # cannot write it: it stays in the outbox for the next start
    assert len(list(outbox.iterdir())) == 1
    switch.available = True
    meter = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=outbox)
    await meter.start()
    await meter.stop()
    assert await stored(sessionmaker) == ["during-stop", "left", "r0", "r1", "r2"]
    assert list(outbox.iterdir()) == []
    await switch.engine.dispose()


async def test_backlog_cap_drops_from_memory_but_not_from_the_outbox(sessionmaker, tmp_path):
    outbox = tmp_path / "outbox"
    meter = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=outbox, max_pending=2)
    for i in range(3):
        meter.record(**record(f"r{i}"))
    assert meter.pending == 2
    await meter.flush()
    assert await stored(sessionmaker) == ["r1", "r2"]
    assert meter.outbox is not None
    meter.outbox.close()  # the dropped record keeps its segment: the next start has it
    again = UsageMeter(sessionmaker, flush_interval_s=60, outbox_dir=outbox)
    await again.start()
    await again.stop()
    assert await stored(sessionmaker) == ["r0", "r1", "r2"]
    assert list(outbox.iterdir()) == []
