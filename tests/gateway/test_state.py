"""The gateway's shared state: shutdown settles spawned work, but never waits forever."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.app import create_app
from tests.gateway.support import in_process, settings


async def test_shutdown_waits_for_spawned_writes_then_gives_up_on_a_stuck_one(
        sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr("gateway.state.BACKGROUND_GRACE_S", 0.5)
    settled, stuck = asyncio.Event(), asyncio.Event()

    async def write() -> None:
        await asyncio.sleep(0.05)
        settled.set()

    async def hang() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            stuck.set()
            raise

    app = create_app(settings(sqlite_url, tmp_path))
    async with in_process(app):
        app.state.gateway.spawn(write())
        app.state.gateway.spawn(hang())
        started = time.monotonic()
    assert time.monotonic() - started < 10
    assert settled.is_set()  # the quick write was awaited, not cut off
    assert stuck.is_set()  # the stuck one was cancelled after the grace
    assert "shutdown left 1 background task(s) unfinished" in caplog.text
    assert "hang" in caplog.text  # named by what it runs
