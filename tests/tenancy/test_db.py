"""Engine set-up: SQLite pragmas, and sessions that keep objects readable after commit."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from tenancy import service
from tenancy.db import is_sqlite, make_engine, make_sessionmaker


async def test_sqlite_connections_get_wal_foreign_keys_and_busy_timeout(tmp_path: Path) -> None:
    """WAL with synchronous NORMAL (1): a commit is not fsynced (FULL is 2), as the usage
    outbox's records are not by default."""
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    try:
        async with engine.connect() as conn:
            assert (await conn.scalar(text("PRAGMA journal_mode"))) == "wal"
            assert (await conn.scalar(text("PRAGMA foreign_keys"))) == 1
            assert (await conn.scalar(text("PRAGMA busy_timeout"))) >= 1000
            assert (await conn.scalar(text("PRAGMA synchronous"))) == 1
    finally:
        await engine.dispose()


def test_backend_detection() -> None:
    assert is_sqlite("sqlite+aiosqlite:///x.db")
    assert not is_sqlite("postgresql+asyncpg://u@h/db")


def test_making_an_engine_opens_no_connection(tmp_path: Path) -> None:
    path = tmp_path / "never.db"
    make_engine(f"sqlite+aiosqlite:///{path}")
    make_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    assert not path.exists()


async def test_objects_stay_readable_after_commit(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as session:
            plan = await service.create_plan(session, name="p", rpm=3)
        # Outside the session, no lazy refresh is needed to read the committed attributes.
        assert (plan.name, plan.rpm, plan.budget_period) == ("p", 3, "month")
        assert plan.created_at.tzinfo is not None
    finally:
        await engine.dispose()
