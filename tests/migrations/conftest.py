"""`blank_db_url`: an empty, unmigrated database on SQLite and on the real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.dbutil import BACKENDS, blank_database


@pytest.fixture(params=BACKENDS)
async def blank_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    async with blank_database(request.param, tmp_path) as url:
        yield url
