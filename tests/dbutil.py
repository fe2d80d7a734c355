"""Throwaway databases for tests: a fresh PostgreSQL database per test, or a SQLite file.

Each PostgreSQL database gets a random name (`sb_test_<hex>`), so parallel runs and other
suites never collide; it is dropped (with FORCE) afterwards. Reuse `migrated_database` to
build fixtures:

    @pytest.fixture(params=["sqlite", "postgres"])
    async def db_url(request, tmp_path):
        async with migrated_database(request.param, tmp_path) as url:
            yield url
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from sqlalchemy.engine import URL, make_url

# Any database on the server works as the entry point; new databases are created beside it.
POSTGRES_URL = os.environ.get(
    "SWITCHBOARD_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
BACKENDS = ("sqlite", "postgres")


async def _admin_connection(url: URL):  # -> asyncpg.Connection
    import asyncpg

    return await asyncpg.connect(
        host=url.host or "127.0.0.1",
        port=url.port or 5432,
        user=url.username or "postgres",
        password=url.password,
        database=url.database or "postgres",
        timeout=5,
    )


async def postgres_available() -> bool:
    """Whether the test PostgreSQL server answers (tests skip with a reason if not)."""
    try:
        conn = await _admin_connection(make_url(POSTGRES_URL))
    except Exception:  # refused, timed out, auth failed: all mean "not available here"
        return False
    await conn.close()
    return True


async def fresh_postgres_url() -> str:
    """Create an empty database with a random name; returns its asyncpg URL."""
    base = make_url(POSTGRES_URL)
    name = f"sb_test_{secrets.token_hex(6)}"
    conn = await _admin_connection(base)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return base.set(database=name).render_as_string(hide_password=False)


async def drop_postgres(url: str) -> None:
    """Drop a database made by `fresh_postgres_url`, even with connections still open."""
    target = make_url(url)
    name = target.database or ""
    if not name.startswith("sb_test_"):
        raise ValueError(f"refusing to drop {name!r}: not a test database")
    conn = await _admin_connection(make_url(POSTGRES_URL))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@asynccontextmanager
async def blank_database(backend: str, tmp_path: Path) -> AsyncIterator[str]:
    """An empty (unmigrated) database URL on `backend` ("sqlite" or "postgres")."""
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / f'sb-{secrets.token_hex(4)}.db'}"
        return
    if backend != "postgres":
        raise ValueError(f"unknown backend {backend!r}")
    if not await postgres_available():
        pytest.skip(f"PostgreSQL not reachable at {make_url(POSTGRES_URL)!r}")
    url = await fresh_postgres_url()
    try:
        yield url
    finally:
        await drop_postgres(url)


@asynccontextmanager
async def migrated_database(backend: str, tmp_path: Path) -> AsyncIterator[str]:
    """A database URL on `backend`, migrated to head and otherwise empty."""
    from tenancy.migrate import upgrade

    async with blank_database(backend, tmp_path) as url:
        # alembic's API is synchronous: run it on a thread while this loop keeps running.
        await asyncio.to_thread(upgrade, url)
        yield url
