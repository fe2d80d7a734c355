"""Adapter tiers and slots, pure Python: exact slot ids, LRU order, what may never move."""

from __future__ import annotations

import pytest

from workers.engine.sampling_params import InvalidRequestError
from workers.lora.manager import AdapterBusyError, LoRAManager, UnknownAdapterError


def manager(max_loras: int = 2, max_cpu_loras: int = 3, count: int = 4) -> LoRAManager:
    m = LoRAManager(max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    for i in range(count):
        add(m, f"a{i}")
    return m


def add(m: LoRAManager, name: str, *, pinned: bool = False) -> None:
    """Register and hand over a (stand-in) CPU copy, as the engine does."""
    m.put_cpu(m.add(name, f"/adapters/{name}", pinned=pinned), f"weights-{name[1:]}")


def ids(m: LoRAManager, *names: str) -> list[int]:
    return [m.entries[n].lora_id for n in names]


def test_slots_are_assigned_lru_and_copies_reported():
    m = manager(max_cpu_loras=4)
    a0, a1, a2 = ids(m, "a0", "a1", "a2")
    assert m.assign_slots({a0, a1}, {a0, a1}) == [(0, "weights-0"), (1, "weights-1")]
    assert m.assign_slots({a0}, {a0}) == []  # resident: nothing to copy
    # a1's slot is the least recently used and a1 is no longer running
    assert m.assign_slots({a2}, {a0, a2}) == [(1, "weights-2")]
    assert m.slots == [a0, a2] and m.num_device_evictions == 1
    assert {s.name: s.tier for s in m.status()} == {
        "a0": "device", "a1": "cpu", "a2": "device", "a3": "cpu"}


def test_running_and_pinned_adapters_keep_their_slots():
    m = manager(max_loras=3, max_cpu_loras=4)
    a0, a1, a2, a3 = ids(m, "a0", "a1", "a2", "a3")
    m.add("a0", "/adapters/a0", pinned=True)  # idempotent, now pinned
    m.assign_slots({a0, a1, a2}, {a0, a1, a2})
    m.assign_slots({a1}, {a1, a2})  # a0 is idle but pinned, a2 running, a1 just used
    # the only slot that may go is... none of a0 (pinned) or a2 (running): a1's
    assert m.assign_slots({a3}, {a2, a3}) == [(1, "weights-3")]
    assert m.slots == [a0, a3, a2]


def test_cpu_tier_evicts_idle_copies_only():
    m = manager(max_loras=1, max_cpu_loras=2, count=2)
    (a0,) = ids(m, "a0")
    m.acquire(m.entries["a0"])  # a request in flight holds a0's copy
    add(m, "a2")
    assert m.entries["a0"].adapter == "weights-0"
    assert m.entries["a1"].adapter is None and m.num_cpu_evictions == 1
    assert [s.tier for s in m.status()] == ["cpu", "disk", "cpu"]
    m.release(a0)
    m.assign_slots({m.entries["a2"].lora_id}, set())
    add(m, "a3")
    assert m.entries["a0"].adapter is None  # idle and not on the device: it goes first
    assert m.entries["a2"].adapter == "weights-2"  # on the device: its copy stays


def test_parked_requests_wait_for_the_read():
    m = manager(max_loras=1, max_cpu_loras=1, count=2)
    entry = m.entries["a0"]
    assert entry.adapter is None
    m.park(entry, "seq")  # type: ignore[arg-type]
    assert m.pending_reads() == [("a0", "/adapters/a0")]
    assert m.put_cpu(entry, "weights-0") == ["seq"]
    assert m.pending_reads() == [] and entry.parked == []


def test_registration_errors():
    m = manager(max_loras=2)
    with pytest.raises(InvalidRequestError, match="another path"):
        m.add("a0", "/elsewhere")
    with pytest.raises(UnknownAdapterError, match="'zz' is not loaded"):
        m.get("zz")
    m.acquire(m.entries["a1"])
    with pytest.raises(AdapterBusyError, match="1 requests in flight"):
        m.remove("a1")
    m.remove("nope")  # unknown: nothing to do
    add(m, "p", pinned=True)
    with pytest.raises(InvalidRequestError, match="pinning leaves fewer than one"):
        add(m, "a2", pinned=True)
    with pytest.raises(ValueError, match="max_cpu_loras >= max_loras"):
        LoRAManager(max_loras=4, max_cpu_loras=2)
