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


async def test_stop_ends_a_loop_whose_step_swallows_the_cancel():
    """A step whose client turns the cancel into its own timeout error (which the loop
    survives) must not leave stop() waiting forever: the regression behind a shutdown hang."""
    entered = asyncio.Event()

    async def step() -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise TimeoutError from None  # what a racing timeout does with the cancel

    loop = Periodic(step, interval_s=0.01, name="swallower", survive=(TimeoutError,))
    loop.start()
    await entered.wait()
    await asyncio.wait_for(loop.stop(), timeout=5)
    assert not loop.running


async def test_stop_gives_up_on_a_loop_that_ignores_every_cancel(monkeypatch, caplog):
    monkeypatch.setattr("workers.periodic.STOP_RETRY_S", 0.01)
    release = asyncio.Event()
    entered = asyncio.Event()

    async def step() -> None:
        entered.set()
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # a step that never lets go

    loop = Periodic(step, interval_s=0.01, name="stubborn", survive=())
    loop.start()
    task = loop._task
    await entered.wait()
    await asyncio.wait_for(loop.stop(), timeout=5)
    assert "stubborn ignored 10 cancels" in caplog.text
    release.set()
    task.cancel()  # wakes the step, which lets go now; the loop then ends on the stop flag
    await asyncio.wait_for(task, timeout=5)
    assert task.done() and not task.cancelled()
