"""Gateway fixtures: a mock provider upstream, databases on both backends, a tiny engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.dbutil import BACKENDS, migrated_database
from tests.gateway.support import MockUpstream


@pytest.fixture(scope="session")
def mock_upstream() -> Iterator[MockUpstream]:
    upstream = MockUpstream().start()
    yield upstream
    upstream.stop()


@pytest.fixture
async def sqlite_url(tmp_path: Path) -> AsyncIterator[str]:
    async with migrated_database("sqlite", tmp_path) as url:
        yield url


@pytest.fixture(params=BACKENDS)
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    async with migrated_database(request.param, tmp_path) as url:
        yield url
