"""`switchboard serve`'s first start: one bootstrap admin key, even when replicas race."""

from __future__ import annotations

import asyncio

from gateway.cli import _bootstrap_admin_key
from tenancy import service
from tenancy.db import make_engine, make_sessionmaker
from tests.dbutil import migrated_database
from tests.gateway.support import settings


async def test_replicas_starting_together_create_one_bootstrap_key(tmp_path):
    async with migrated_database("postgres", tmp_path) as db_url:
        cfg = settings(db_url, tmp_path)
        keys = await asyncio.gather(*(_bootstrap_admin_key(cfg) for _ in range(4)))
        assert len([k for k in keys if k is not None]) == 1
        assert await _bootstrap_admin_key(cfg) is None  # and later starts create none
        engine = make_engine(db_url)
        try:
            async with make_sessionmaker(engine)() as session:
                assert await service.count_admin_keys(session) == 1
        finally:
            await engine.dispose()
