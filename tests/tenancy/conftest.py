"""Database fixtures for tenancy tests, each run on SQLite and on the real PostgreSQL.

`db_url`: a migrated, empty database URL; `db_engine`: an AsyncEngine on it;
`session`: an AsyncSession from `tenancy.db.make_sessionmaker`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from tenancy.db import make_engine, make_sessionmaker
from tests.dbutil import BACKENDS, migrated_database


@pytest.fixture(params=BACKENDS)
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    async with migrated_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
async def db_engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(db_url)
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
async def session(db_engine: AsyncEngine) -> AsyncIterator[AsyncSession]:
    async with make_sessionmaker(db_engine)() as session:
        yield session


@pytest.fixture
def pepper() -> bytes:
    return b"test-pepper-0123456789abcdef"
