"""Gateway fixtures: a mock provider upstream, databases on both backends, a tiny engine, and
a module's named in-process mock upstreams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from bench.common.mock_upstream import MockServerThread
from tests.dbutil import BACKENDS, migrated_database
from tests.gateway.support import MockUpstream, mock_servers


@pytest.fixture(scope="session")
def mock_upstream() -> Iterator[MockUpstream]:
    upstream = MockUpstream().start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def mock_fleet(request: pytest.FixtureRequest) -> Iterator[dict[str, MockServerThread]]:
    """One in-process mock upstream per name in the test module's MOCKS, started once for the
    module: starting them per test would cost more than most of the tests."""
    names: tuple[str, ...] = getattr(request.module, "MOCKS", ())
    if not names:
        pytest.fail(f"{request.module.__name__} uses `mocks` but names no MOCKS", pytrace=False)
    with mock_servers(*names) as servers:
        yield servers


@pytest.fixture
def mocks(mock_fleet: dict[str, MockServerThread]) -> dict[str, MockServerThread]:
    """The module's mock upstreams, reset to healthy: no test sees a mode another one set."""
    for server in mock_fleet.values():
        server.mock.reset()
    return mock_fleet


@pytest.fixture
async def sqlite_url(tmp_path: Path) -> AsyncIterator[str]:
    async with migrated_database("sqlite", tmp_path) as url:
        yield url


@pytest.fixture(params=BACKENDS)
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    async with migrated_database(request.param, tmp_path) as url:
        yield url
