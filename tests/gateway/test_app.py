"""The app's lifespan: what it does to the process once started."""

from __future__ import annotations

import gc

from gateway.app import create_app
from tests.gateway.support import in_process, settings


async def test_the_heap_built_at_startup_is_frozen_out_of_collections(sqlite_url, tmp_path):
    # a full collection walking it paused a loaded gateway 250-300 ms (its p99 at c=32)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    before = gc.get_threshold()
    cfg = settings(sqlite_url, tmp_path, gc_freeze=True, gc_thresholds=(50_000, 20, 30))
    try:
        async with in_process(create_app(cfg)) as c:
            assert (await c.get("/health")).status_code == 200
            assert gc.get_freeze_count() > 10_000  # modules, the app, its state
            assert gc.get_threshold() == (50_000, 20, 30)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


async def test_the_test_settings_leave_the_collector_alone(sqlite_url, tmp_path):
    gc.unfreeze()
    before = gc.get_threshold()
    async with in_process(create_app(settings(sqlite_url, tmp_path))) as c:
        assert (await c.get("/health")).status_code == 200
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before
