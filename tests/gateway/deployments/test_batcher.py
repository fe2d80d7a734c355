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
        self.steps: asyncio.Semaphore | None = None  # one release: one forward ends
        self.fail = False

    def steps_left_open(self) -> None:
        """Every forward from now on ends at once (the one waiting included)."""
        steps, self.steps = self.steps, None
        if steps is not None:
            steps.release()

    async def __call__(self, rows: Rows) -> np.ndarray:
        self.forwards.append(rows)
        if self.gate is not None:
            await self.gate.wait()
        if self.steps is not None:
            await self.steps.acquire()
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


# --- tenants share the model fairly -------------------------------------------------------


def tenant_of(row: list[int]) -> str:
    return "a" if row[0] < 1000 else "b"


async def test_another_tenant_s_small_request_goes_into_the_next_forward() -> None:
    model = FakeModel()
    model.gate = asyncio.Event()
    batcher = MicroBatcher(model, max_rows=4)
    big = asyncio.ensure_future(batcher.embed(rows(*([2] * 40)), tenant="a"))
    await asyncio.sleep(0)  # the first forward (4 of a's rows) is running
    answered_after: list[int] = []
    small = asyncio.ensure_future(batcher.embed(
        rows(2, first=1000), tenant="b",
        progress=lambda n, gone: answered_after.append(len(model.forwards))))
    await asyncio.sleep(0)
    model.gate.set()
    assert (await small).tolist() == [[1000, 2]]
    assert answered_after == [2]  # by the very next forward, not the 11th
    assert [tenant_of(r) for r in model.forwards[1]] == ["b", "a", "a", "a"]
    assert (await big)[:, 0].tolist() == list(range(40))
    assert batcher.tokens == {"a": 80, "b": 2}
    assert batcher.counters == {}  # nobody busy: nothing kept


async def test_backlogged_tenants_split_rows_by_weight() -> None:
    model = FakeModel()
    model.gate = asyncio.Event()
    batcher = MicroBatcher(model, max_rows=8)
    a = asyncio.ensure_future(batcher.embed(rows(*([3] * 64)), tenant="a", weight=1.0))
    b = asyncio.ensure_future(batcher.embed(rows(*([3] * 64), first=1000), tenant="b",
                                            weight=3.0))
    await asyncio.sleep(0)
    model.gate.set()
    await asyncio.gather(a, b)
    early = [tenant_of(r) for forward in model.forwards[:4] for r in forward]
    assert early.count("b") == 3 * early.count("a")  # 24 to 8 while both are backlogged


async def test_idle_time_is_not_banked() -> None:
    """A tenant that arrives after another has been served for long starts level with it:
    the two alternate, the newcomer does not take every row until it has caught up."""
    model = FakeModel()
    model.steps = asyncio.Semaphore(0)
    batcher = MicroBatcher(model, max_rows=4)
    a = asyncio.ensure_future(batcher.embed(rows(*([5] * 40)), tenant="a"))
    while len(model.forwards) < 5:  # a alone: 4 forwards done, 80 tokens served
        model.steps.release()
        await asyncio.sleep(0)
    b = asyncio.ensure_future(batcher.embed(rows(*([5] * 8), first=1000), tenant="b"))
    model.steps_left_open()
    await asyncio.gather(a, b)
    assert [tenant_of(r) for r in model.forwards[5]] == ["b", "a", "b", "a"]
    assert [tenant_of(r) for r in model.forwards[6]] == ["b", "a", "b", "a"]


async def test_within_a_tenant_the_more_urgent_request_first() -> None:
    model = FakeModel()
    model.gate = asyncio.Event()
    batcher = MicroBatcher(model, max_rows=2)
    first = asyncio.ensure_future(batcher.embed(rows(1), tenant="a"))
    await asyncio.sleep(0)
    later = asyncio.ensure_future(batcher.embed(rows(1, 1, first=10), tenant="a", priority=1))
    urgent = asyncio.ensure_future(batcher.embed(rows(1, 1, first=20), tenant="a", priority=-1))
    await asyncio.sleep(0)
    model.gate.set()
    await asyncio.gather(first, later, urgent)
    assert [[r[0] for r in f] for f in model.forwards] == [[0], [20, 21], [10, 11]]


# --- what a request has cost, as it runs --------------------------------------------------


async def test_progress_counts_the_rows_computed() -> None:
    model = FakeModel()
    batcher = MicroBatcher(model, max_rows=2)
    seen: list[tuple[int, bool]] = []
    await batcher.embed(rows(1, 2, 3, 4, 5), progress=lambda n, gone: seen.append((n, gone)))
    assert seen == [(3, False), (10, False), (15, False)]


async def test_a_caller_that_leaves_pays_for_the_rows_computed_or_running() -> None:
    model = FakeModel()
    model.steps = asyncio.Semaphore(0)
    batcher = MicroBatcher(model, max_rows=2)
    seen: list[tuple[int, bool]] = []
    job = asyncio.ensure_future(batcher.embed(rows(*([4] * 10)), tenant="a",
                                              progress=lambda n, gone: seen.append((n, gone))))
    model.steps.release()
    while len(model.forwards) < 2:  # one forward done, the second one running
        await asyncio.sleep(0)
    job.cancel()
    await asyncio.gather(job, return_exceptions=True)
    assert seen == [(8, False), (16, True)]  # the rows of the running forward count
    model.steps_left_open()
    other = await batcher.embed(rows(1, first=7), tenant="b")  # a's other rows never run
    assert other.tolist() == [[7, 1]] and len(model.forwards) == 3
    assert batcher.tokens == {"a": 16, "b": 1} and batcher.pending_rows == 0


async def test_a_failed_forward_reports_only_what_was_computed() -> None:
    model = FakeModel()
    batcher = MicroBatcher(model, max_rows=2)
    seen: list[int] = []
    calls = 0

    async def failing_second(batch: Rows) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("out of memory")
        return await model(batch)

    batcher._forward = failing_second
    with pytest.raises(RuntimeError):
        await batcher.embed(rows(1, 1, 1, 1, 1), progress=lambda n, gone: seen.append(n))
    assert seen == [2]


async def test_close_fails_requests_in_a_running_forward() -> None:
    model = FakeModel()
    model.gate = asyncio.Event()
    batcher = MicroBatcher(model, max_rows=1)
    running = asyncio.ensure_future(batcher.embed(rows(1)))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await batcher.close()
    with pytest.raises((RuntimeError, asyncio.CancelledError)):
        await asyncio.wait_for(running, 1)
