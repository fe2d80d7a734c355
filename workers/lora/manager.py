"""Which adapters the engine knows, where each one lives, and who is using it.

Pure Python, owned by the step thread. Three tiers, as in LoRAX/S-LoRA:

- device: up to `max_loras` slots the forward pass reads; least recently used slot first out,
  never one a running request uses or one that is pinned;
- cpu: up to `max_cpu_loras` loaded copies (slot loads copy from here); least recently used
  first out, never one with requests in flight;
- disk: only the path is kept; a request for it parks until the copy is read again, off the
  step loop.

Each registration gets a fresh `lora_id`, which is what the prefix cache keys on: KV computed
under one adapter is never served to another, nor to a later adapter of the same name.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from workers.engine.sampling_params import InvalidRequestError
from workers.engine.sequence import Sequence


class UnknownAdapterError(InvalidRequestError):
    """No adapter of that name is registered (HTTP 404)."""


class AdapterBusyError(RuntimeError):
    """The adapter still has requests in flight (HTTP 409)."""


@dataclass(eq=False)
class AdapterEntry:
    name: str
    lora_id: int
    path: str
    pinned: bool = False
    adapter: Any | None = None  # the CPU copy (a LoRAAdapter); None while only on disk
    num_requests: int = 0  # queued, parked or running
    draining: bool = False  # being unloaded: new requests are refused
    parked: list[Sequence] = field(default_factory=list)  # waiting for the disk read


@dataclass(frozen=True)
class AdapterStatus:
    name: str
    tier: str  # "device" | "cpu" | "disk"
    pinned: bool
    num_requests: int
    rank: int | None


class LoRAManager:
    def __init__(self, *, max_loras: int, max_cpu_loras: int) -> None:
        if max_loras < 1 or max_cpu_loras < max_loras:
            raise ValueError("need max_loras >= 1 and max_cpu_loras >= max_loras")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.entries: dict[str, AdapterEntry] = {}
        self.by_id: dict[int, AdapterEntry] = {}
        self.pinned_ids: set[int] = set()  # shared with the scheduler
        self.slot_of: dict[int, int] = {}  # lora_id -> device slot
        self.slots: list[int | None] = [None] * max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))
        self._cpu_lru: OrderedDict[str, None] = OrderedDict()
        self._awaiting_read: dict[str, AdapterEntry] = {}  # adapters with parked requests
        self._ids = itertools.count(1)
        self.num_device_loads = 0
        self.num_device_evictions = 0
        self.num_cpu_evictions = 0

    # ---- registration ---------------------------------------------------------------------

    def add(self, name: str, path: str, *, pinned: bool = False) -> AdapterEntry:
        """Register (idempotent for the same path); the caller then hands over the CPU copy
        with `put_cpu`."""
        entry = self.entries.get(name)
        if entry is None:
            entry = AdapterEntry(name, next(self._ids), path)
            self.entries[name] = entry
            self.by_id[entry.lora_id] = entry
        elif entry.path != path:
            raise InvalidRequestError(
                f"adapter {name!r} is already loaded from another path; unload it first")
        if pinned and not entry.pinned:
            self._pin(entry)
        return entry

    def remove(self, name: str) -> None:
        """Forget an adapter; refuses while requests use it. Unknown names are a no-op."""
        entry = self.entries.get(name)
        if entry is None:
            return
        if entry.num_requests:
            raise AdapterBusyError(
                f"adapter {name!r} has {entry.num_requests} requests in flight")
        del self.entries[name]
        del self.by_id[entry.lora_id]
        self.pinned_ids.discard(entry.lora_id)
        self._cpu_lru.pop(name, None)
        self._awaiting_read.pop(name, None)
        slot = self.slot_of.pop(entry.lora_id, None)
        if slot is not None:
            self.slots[slot] = None
            self._slot_lru.move_to_end(slot, last=False)  # reuse it first

    def get(self, name: str) -> AdapterEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded", code="model_not_found",
                                      param="model")
        if entry.draining:
            raise UnknownAdapterError(f"adapter {name!r} is being unloaded",
                                      code="model_not_found", param="model")
        return entry

    def _pin(self, entry: AdapterEntry) -> None:
        if len(self.pinned_ids) + 1 >= self.max_loras:
            raise InvalidRequestError(
                f"cannot pin {entry.name!r}: pinning leaves fewer than one of max_loras="
                f"{self.max_loras} slots for other adapters")
        entry.pinned = True
        self.pinned_ids.add(entry.lora_id)

    # ---- requests -------------------------------------------------------------------------

    def acquire(self, entry: AdapterEntry) -> None:
        entry.num_requests += 1
        if entry.adapter is not None:
            self._cpu_lru.move_to_end(entry.name)

    def release(self, lora_id: int) -> None:
        entry = self.by_id.get(lora_id)
        if entry is not None and entry.num_requests > 0:
            entry.num_requests -= 1

    def park(self, entry: AdapterEntry, seq: Sequence) -> None:
        """Hold a request of an adapter that is only on disk until its copy is read."""
        entry.parked.append(seq)
        self._awaiting_read[entry.name] = entry

    def unpark(self, entry: AdapterEntry, request_id: str | None = None) -> list[Sequence]:
        """Take back the parked sequences (of one request, or all); they are returned."""
        if request_id is None:
            taken, entry.parked = entry.parked, []
        else:
            taken = [s for s in entry.parked if s.request_id == request_id]
            entry.parked = [s for s in entry.parked if s.request_id != request_id]
        if not entry.parked:
            self._awaiting_read.pop(entry.name, None)
        return taken

    def put_cpu(self, entry: AdapterEntry, adapter: Any) -> list[Sequence]:
        """Hold a CPU copy; returns the sequences that were parked waiting for it."""
        entry.adapter = adapter
        self._cpu_lru[entry.name] = None
        self._cpu_lru.move_to_end(entry.name)
        self._evict_cpu()
        return self.unpark(entry)

    def pending_reads(self) -> list[tuple[str, str]]:
        """(name, path) of adapters whose parked requests wait for a disk read."""
        return [(e.name, e.path) for e in self._awaiting_read.values()]

    def _evict_cpu(self) -> None:
        for name in list(self._cpu_lru):
            if len(self._cpu_lru) <= self.max_cpu_loras:
                return
            entry = self.entries[name]
            if entry.num_requests or entry.pinned or entry.lora_id in self.slot_of:
                continue
            entry.adapter = None
            del self._cpu_lru[name]
            self.num_cpu_evictions += 1

    # ---- device slots ---------------------------------------------------------------------

    def assign_slots(self, lora_ids: set[int], active: set[int]) -> list[tuple[int, Any]]:
        """Give every adapter of this step a slot; (slot, adapter) copies the runner must do.

        `active` are the adapters of all running requests: their slots are never taken."""
        loads = []
        protected = active | self.pinned_ids
        for lora_id in sorted(lora_ids):
            slot = self.slot_of.get(lora_id)
            if slot is None:
                slot = next(s for s in self._slot_lru
                            if self.slots[s] is None or self.slots[s] not in protected)
                old = self.slots[slot]
                if old is not None:
                    del self.slot_of[old]
                    self.num_device_evictions += 1
                    self._evict_cpu()  # the evicted one may now leave the CPU tier too
                entry = self.by_id[lora_id]
                assert entry.adapter is not None, "scheduled adapter has no CPU copy"
                self.slots[slot] = lora_id
                self.slot_of[lora_id] = slot
                loads.append((slot, entry.adapter))
                self.num_device_loads += 1
            self._slot_lru.move_to_end(slot)
        return loads

    def tier_of(self, name: str) -> str | None:
        """Where a registered adapter is now, None if it is not registered."""
        entry = self.entries.get(name)
        return None if entry is None else self._tier(entry)

    def _tier(self, entry: AdapterEntry) -> str:
        if entry.lora_id in self.slot_of:
            return "device"
        return "cpu" if entry.adapter is not None else "disk"

    def status(self) -> list[AdapterStatus]:
        out = []
        for entry in self.entries.values():
            tier = self._tier(entry)
            rank = getattr(entry.adapter, "rank", None)
            out.append(AdapterStatus(entry.name, tier, entry.pinned, entry.num_requests, rank))
        return out
