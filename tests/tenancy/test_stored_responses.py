"""Stored responses (the Responses API's `store`): written off the answer's path, in group
commits, yet found by a read right after, on the replica that answered (it waits for the
queued write) and on another (a fresh id is looked for again, briefly); scoped by tenant.
Both databases."""

from __future__ import annotations

import asyncio
import time

import pytest

from tenancy import service, stored_responses
from tenancy.db import make_engine, make_sessionmaker
from tenancy.stored_responses import Keeper, minted_at, new_response_id


@pytest.fixture
async def replicas(db_url):
    """Two gateways' views of one database (each its own engine and session factory), a
    tenant and another, and a spawner whose writes can be held back."""
    engines = [make_engine(db_url), make_engine(db_url)]
    makers = [make_sessionmaker(e) for e in engines]
    async with makers[0]() as session:
        plan = await service.create_plan(session, name="p")
        mine = await service.create_tenant(session, name="mine", plan_id=plan.id)
        theirs = await service.create_tenant(session, name="theirs", plan_id=plan.id)
    held = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    def spawn_held(work):
        async def later():
            await held.wait()
            await work
        task = asyncio.get_running_loop().create_task(later())
        tasks.add(task)

    yield makers, mine.id, theirs.id, spawn_held, held
    held.set()
    await asyncio.gather(*tasks)
    for engine in engines:
        await engine.dispose()


def row(response_id: str, tenant_id: str) -> dict:
    return {"response_id": response_id, "tenant_id": tenant_id, "status": "completed",
            "previous_response_id": None, "body": {"id": response_id, "output": []},
            "input_items": [{"type": "message"}], "history": []}


def test_ids_carry_their_time():
    rid = new_response_id(now=1_800_000_000.25)
    assert rid.startswith("resp_") and len(rid) == 37
    assert minted_at(rid) == 1_800_000_000.25
    assert minted_at("resp_nope") is None and minted_at("msg_0123456789abcdef") is None


async def test_a_queued_write_is_found_at_once_on_its_replica_and_soon_on_another(
        replicas, monkeypatch):
    makers, mine, theirs, spawn_held, held = replicas
    here = Keeper(makers[0], spawn_held)
    there = Keeper(makers[1], spawn_held)
    rid = new_response_id()
    here.keep(**row(rid, mine))  # queued; its write is held back

    async def release_soon():
        await asyncio.sleep(0.3)
        held.set()

    started = time.monotonic()
    release = asyncio.ensure_future(release_soon())
    found_here = await here.find(rid, mine)  # from the queue: no wait for the held write
    assert time.monotonic() - started < 0.2 and not held.is_set()
    found_there = await there.find(rid, mine)  # the other replica: once it is written
    await release
    assert found_here is not None and found_there is not None
    assert found_here.body == {"id": rid, "output": []} and found_there.input_items
    assert found_here.input_items == found_there.input_items == [{"type": "message"}]
    assert 0.25 < time.monotonic() - started < stored_responses.FRESH_S

    # Another tenant never sees it, and waits as for an unknown fresh id.
    monkeypatch.setattr(stored_responses, "FRESH_S", 0.2)
    assert await there.find(rid, theirs) is None
    assert await here.find(new_response_id(), mine) is None
    started = time.monotonic()
    assert await there.find("resp_" + "0" * 32, mine) is None  # old: no second look
    assert await there.find("not-an-id", mine) is None
    assert time.monotonic() - started < 0.15

    assert not await there.remove(rid, theirs)
    assert await there.remove(rid, mine)
    assert await here.find(rid, mine) is None


class Counting:
    """A session factory that counts the sessions opened."""

    def __init__(self, maker) -> None:
        self.maker = maker
        self.opened = 0

    def __call__(self):
        self.opened += 1
        return self.maker()


async def test_writes_queued_together_share_a_transaction(replicas):
    makers, mine, _, spawn_held, held = replicas
    counting = Counting(makers[0])
    keeper = Keeper(counting, spawn_held)
    ids = [new_response_id() for _ in range(20)]
    for rid in ids:
        keeper.keep(**row(rid, mine))
    held.set()
    while stored_responses._writes[counting].pending:
        await asyncio.sleep(0.01)
    assert counting.opened == 1  # twenty answers, one write
    found = await asyncio.gather(*(keeper.find(rid, mine) for rid in ids))
    assert [f.id for f in found] == ids


async def test_answers_kept_one_after_another_share_a_transaction(replicas, monkeypatch):
    # a gateway at concurrency 1 keeps one answer at a time: the first write waits GROUP_S for
    # the next ones instead of paying a transaction each (a long window here: a slow machine
    # must not split the five)
    monkeypatch.setattr(stored_responses, "GROUP_S", 0.5)
    makers, mine, *_ = replicas
    counting = Counting(makers[0])
    tasks: list[asyncio.Task] = []
    keeper = Keeper(counting, lambda work: tasks.append(asyncio.ensure_future(work)))
    ids = [new_response_id() for _ in range(5)]
    for rid in ids:
        keeper.keep(**row(rid, mine))
        await asyncio.sleep(0)  # the write in flight gets its turn between answers
    await asyncio.gather(*tasks)
    assert (len(tasks), counting.opened) == (1, 1)
    found = await asyncio.gather(*(keeper.find(rid, mine) for rid in ids))
    assert [f.id for f in found] == ids


async def test_deleting_a_queued_response_waits_for_its_write(replicas, monkeypatch):
    """A delete that ran before the queued insert would be undone by it. Another tenant
    neither reads nor deletes it from the queue."""
    makers, mine, theirs, spawn_held, held = replicas
    monkeypatch.setattr(stored_responses, "FRESH_S", 0.2)
    keeper = Keeper(makers[0], spawn_held)
    rid = new_response_id()
    keeper.keep(**row(rid, mine))
    assert await keeper.find(rid, theirs) is None
    assert not await keeper.remove(rid, theirs)
    removing = asyncio.ensure_future(keeper.remove(rid, mine))
    await asyncio.sleep(0.1)
    assert not removing.done()  # waiting for the held write
    held.set()
    assert await removing
    assert await keeper.find(rid, mine) is None
    assert await Keeper(makers[1], spawn_held).find(rid, mine) is None
