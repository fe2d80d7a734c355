"""LoRA residency as the engine sees it: requests hold their adapter where the step needs it.

`LoRAManager` keeps the tiers (device slots, CPU copies, disk paths). This module ties them to
the engine's requests and steps: a new request takes a reference on its adapter and parks
while that adapter is only on disk; parked requests go to the scheduler once the copy is read
back (by the async engine off the step loop, else at the start of a step); each step's
adapters get device slots before it runs; a finished request lets its adapter go.
Torch-free: reading an adapter is the runner's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from workers.engine.request import Request
from workers.engine.sampling_params import InvalidRequestError
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.lora.manager import AdapterEntry, AdapterStatus, LoRAManager

logger = logging.getLogger(__name__)


class AdapterResidency:
    def __init__(self, manager: LoRAManager | None, scheduler: Scheduler, runner: Any,
                 abort: Callable[[str], Any]) -> None:
        self.manager = manager  # None: the engine serves no adapters (enable_lora off)
        self.scheduler = scheduler
        self.runner = runner
        self._abort = abort

    def require(self) -> LoRAManager:
        if self.manager is None:
            raise InvalidRequestError("this engine does not serve LoRA adapters (enable_lora)",
                                      param="model")
        return self.manager

    # ---- registration ---------------------------------------------------------------------

    def add(self, name: str, path: str, *, adapter: Any = None, pinned: bool = False) -> None:
        """Register an adapter (idempotent). Pass `adapter` when it was read off this thread."""
        loras = self.require()
        if adapter is None:
            adapter = self.runner.read_adapter(name, path)
        loras.add(name, path, pinned=pinned)
        self.put(name, adapter)

    def remove(self, name: str, *, drain: bool = False) -> bool:
        """Forget an adapter; True once gone. While requests use it: refuse (AdapterBusyError)
        or, with `drain`, refuse new requests for it and return False (ask again later)."""
        loras = self.require()
        entry = loras.entries.get(name)
        if entry is not None and entry.num_requests and drain:
            entry.draining = True
            return False
        loras.remove(name)
        return True

    def cancel_unload(self, name: str) -> None:
        entry = self.require().entries.get(name)
        if entry is not None:
            entry.draining = False

    def status(self) -> list[AdapterStatus]:
        return self.manager.status() if self.manager else []

    # ---- requests -------------------------------------------------------------------------

    def lookup(self, name: str | None) -> AdapterEntry | None:
        """The adapter a new request names, refused if it is unknown or being unloaded;
        None for the base model."""
        if name is None:
            return None
        loras = self.require()
        return loras.get(name) if name else None

    def admit(self, entry: AdapterEntry | None, seq: Sequence) -> None:
        """Queue a new request's first sequence; one whose adapter is only on disk parks."""
        if entry is not None:
            assert self.manager is not None
            self.manager.acquire(entry)
            if entry.adapter is None:  # evicted to disk: wait for the read, off the queue
                self.manager.park(entry, seq)
                return
        self.scheduler.add(seq)

    def release(self, request: Request) -> None:
        """A request ended: it no longer holds (or waits for) its adapter."""
        if self.manager is None or request.lora_id is None:
            return
        entry = self.manager.by_id.get(request.lora_id)
        if entry is not None:
            self.manager.unpark(entry, request.request_id)
        self.manager.release(request.lora_id)
        request.lora_id = None

    # ---- reading back from disk -----------------------------------------------------------

    def pending_reads(self) -> list[tuple[str, str]]:
        """Adapters that parked requests wait for: read them (off the step loop), then
        `put` or `fail`."""
        return self.manager.pending_reads() if self.manager else []

    def put(self, name: str, adapter: Any) -> None:
        loras = self.require()
        entry = loras.entries.get(name)
        if entry is None:
            return  # removed while it was being read
        for seq in loras.put_cpu(entry, adapter):
            if not seq.is_finished:
                self.scheduler.add(seq)

    def fail(self, name: str) -> list[str]:
        """The adapter could not be read back: abort its parked requests; their ids."""
        loras = self.require()
        entry = loras.entries.get(name)
        if entry is None:
            return []
        ids = [seq.request_id for seq in loras.unpark(entry)]
        for request_id in ids:
            self._abort(request_id)
        return ids

    def read_parked(self) -> None:
        """Read back, on this thread, what parked requests wait for (the offline engine)."""
        for name, path in self.pending_reads():
            try:
                adapter = self.runner.read_adapter(name, path)
            except (OSError, ValueError):
                logger.exception("adapter %s could not be read back from %s", name, path)
                self.fail(name)
                continue
            self.put(name, adapter)

    # ---- the step -------------------------------------------------------------------------

    def assign_slots(self, sched: SchedulerOutput) -> None:
        """Give the step's adapters device slots; the copies to make go with the step."""
        if self.manager is None:
            return
        ids = {c.lora_id for c in sched.chunks if c.lora_id is not None}
        if not ids:
            return
        sched.lora_loads = self.manager.assign_slots(ids, self.scheduler.active_loras())
        for chunk in sched.chunks:
            if chunk.lora_id is not None:
                chunk.lora_slot = self.manager.slot_of[chunk.lora_id]

    def figures(self) -> dict[str, float]:
        """For the engine's stats (none when adapters are off)."""
        loras = self.manager
        if loras is None:
            return {}
        return {"num_loras": len(loras.entries), "num_loras_on_device": len(loras.slot_of),
                "lora_device_loads": loras.num_device_loads,
                "lora_device_evictions": loras.num_device_evictions,
                "lora_cpu_evictions": loras.num_cpu_evictions}
