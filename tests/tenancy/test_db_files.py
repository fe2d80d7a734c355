"""The SQLite database is created owner-only: it holds key hashes and every tenant's usage."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sqlalchemy import text

from tenancy.db import create_private_sqlite_file, make_engine
from tenancy.migrate import upgrade


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_a_new_database_and_its_wal_files_are_0600(tmp_path: Path) -> None:
    db = tmp_path / "switchboard.db"
    engine = make_engine(f"sqlite+aiosqlite:///{db}")
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t (x INTEGER)"))
            await conn.execute(text("INSERT INTO t VALUES (1)"))
            files = sorted(tmp_path.iterdir())
            assert [p.name for p in files] == ["switchboard.db", "switchboard.db-shm",
                                               "switchboard.db-wal"]
            assert {mode(p) for p in files} == {0o600}
    finally:
        await engine.dispose()


async def test_an_existing_database_keeps_its_mode(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    db.touch()
    os.chmod(db, 0o640)  # an operator's choice
    engine = make_engine(f"sqlite+aiosqlite:///{db}")
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
    assert mode(db) == 0o640


def test_migrations_on_a_new_file_leave_it_0600(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'migrated.db'}"
    upgrade(url)  # what `switchboard serve` and `switchboard migrate` both run
    assert mode(tmp_path / "migrated.db") == 0o600
    create_private_sqlite_file("postgresql+asyncpg://u@127.0.0.1/x")  # nothing to create
    create_private_sqlite_file("sqlite+aiosqlite:///:memory:")
