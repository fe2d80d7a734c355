"""The micro-batcher with a fake model: coalescing, budgets, order, failures, cancellation."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gateway.deployments.batcher import MicroBatcher, Rows


class FakeModel:
    """A row's vector is [first id, length]; each forward is recorded, and can be held."""

    def __init__(self) -> None:
        self.forwards: list[Rows] = []
        self.gate: asyncio.Event | None = None
        self.fail = False

    async def __call__(self, rows: Rows) -> np.ndarray:
        self.forwards.append(rows)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("out of memory")
        return np.array([[row[0], len(row)] for row in rows], dtype=np.float32)


def rows(*lengths: int, first: int = 0) -> Rows:
    return [[first + i] * n for i, n in enumerate(lengths)]


async def test_a_lone_request_runs_at_once_and_keeps_its_order() -> None:
    model = FakeModel()
    batcher = MicroBatcher(model)
    out = await batcher.embed(rows(5, 1, 3))
    assert out.tolist() == [[0, 5], [1, 1], [2, 3]]
    assert model.forwards == [[[1], [2, 2, 2], [0] * 5]]  # shortest first, less padding


async def test_requests_arriving_during_a_forward_share_the_next() -> None:
    model = FakeModel()
    model.gate = asyncio.Event()
    batcher = MicroBatcher(model)
    first = asyncio.ensure_future(batcher.embed(rows(2)))
    await asyncio.sleep(0)
    later = [asyncio.ensure_future(batcher.embed(rows(2, first=10 * i))) for i in range(1, 6)]
    await asyncio.sleep(0)
    model.gate.set()
    results = await asyncio.gather(first, *later)
    assert len(model.forwards) == 2 and len(model.forwards[1]) == 5
    assert [r.tolist() for r in results] == [[[10 * i, 2]] for i in range(6)]
    assert batcher.forwards == 2 and batcher.pending_rows == 0


async def test_budgets_split_big_requests() -> None:
    model = FakeModel()
    batcher = MicroBatcher(model, max_rows=4, max_tokens=20)
    out = await batcher.embed(rows(*([3] * 10), 10))
    assert out[:, 0].tolist() == list(range(11))
    assert [len(f) for f in model.forwards] == [4, 4, 2, 1]  # the last one: 10 x 1 + 3 > 20
    assert all(len(f) * max(map(len, f)) <= 20 for f in model.forwards)


async def test_a_failed_forward_fails_its_requests_only() -> None:
    model = FakeModel()
    batcher = MicroBatcher(model)
    model.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        await batcher.embed(rows(1, 2))
    model.fail = False
    assert (await batcher.embed(rows(1))).tolist() == [[0, 1]]


async def test_a_cancelled_request_is_skipped() -> None:
    model = FakeModel()
    model.gate = asyncio.Event()
    batcher = MicroBatcher(model, max_rows=1)
    running = asyncio.ensure_future(batcher.embed(rows(1)))
    await asyncio.sleep(0)
    left = asyncio.ensure_future(batcher.embed(rows(1, 1, 1, first=5)))
    stays = asyncio.ensure_future(batcher.embed(rows(1, first=9)))
    await asyncio.sleep(0)
    left.cancel()
    model.gate.set()
    assert (await running).tolist() == [[0, 1]]
    assert (await stays).tolist() == [[9, 1]]
    assert [f[0][0] for f in model.forwards] == [0, 9]  # none of the cancelled one's rows


async def test_close_fails_what_waits() -> None:
    model = FakeModel()
    model.gate = asyncio.Event()
    batcher = MicroBatcher(model)
    waiting = asyncio.ensure_future(batcher.embed(rows(1)))
    await asyncio.sleep(0)
    await batcher.close()
    with pytest.raises((RuntimeError, asyncio.CancelledError)):
        await waiting
    with pytest.raises(RuntimeError, match="closed"):
        await batcher.embed(rows(1))
