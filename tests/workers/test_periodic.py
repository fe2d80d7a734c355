"""The shared background loop: runs on its interval, survives what it is told to, stops."""

from __future__ import annotations

import asyncio

import pytest

from workers.periodic import Periodic


async def test_steps_on_its_interval_survives_listed_errors_and_stops(caplog):
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError("secret-host unreachable")

    loop = Periodic(step, interval_s=0.01, name="probe", survive=(OSError,))
    loop.start()
    loop.start()  # idempotent: one task
    await asyncio.sleep(0.2)
    assert loop.running and calls >= 4  # the OSError on the 2nd step did not end it
    await loop.stop()
    assert not loop.running
    seen = calls
    await asyncio.sleep(0.05)
    assert calls == seen
    assert "probe failed (OSError)" in caplog.text and "secret-host" not in caplog.text


async def test_an_unexpected_error_ends_the_loop_loudly():
    async def step() -> None:
        raise ValueError("a bug")

    loop = Periodic(step, interval_s=0.01, name="buggy", survive=(OSError,))
    loop.start()
    await asyncio.sleep(0.05)
    assert not loop.running
    with pytest.raises(ValueError):
        await loop._task  # type: ignore[misc]
    await loop.stop()
