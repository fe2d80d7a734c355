"""Weighted fair share of tokens between tenants: a virtual token counter per tenant (VTC).

Each tenant's counter grows by the tokens the engine computes for it, prompt tokens at
`prompt_weight` and output tokens at `output_weight` (an output token costs a whole step's
read of the weights, a prompt token a share of one), divided by the tenant's weight. The
waiting request admitted next is the one whose tenant has the smallest counter, so while two
tenants are backlogged the tokens served split by their weights.

A tenant that arrives after being idle has its counter lifted to just under the smallest
counter among the tenants that are active: idle time is not banked, so a tenant cannot save
up service and then flood the engine with it, and among equals the newcomer goes first. While
a less-served tenant's request waits and could start, the scheduler also holds back the
prompt chunks of more-served tenants for one step, so the newcomer's first step is short.
Requests without a tenant share one anonymous tenant.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterator

from workers.engine.sequence import Sequence


class FairShare:
    """The counters, and which tenants have work (waiting or running) in the engine."""

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[str | None, float] = {}
        self.tokens: Counter[str | None] = Counter()  # computed per tenant, unweighted
        self.active: Counter[str | None] = Counter()  # live sequences per tenant
        self.last_left: dict[str | None, float] = {}  # when a tenant's last sequence left
        self.weights: dict[str | None, float] = {}  # each tenant's weight, as last sent
        self._live: set[int] = set()

    def arrive(self, seq: Sequence) -> None:
        """A new sequence (not a preempted one coming back): lift an idle tenant's counter."""
        if seq.seq_id in self._live:
            return
        self._live.add(seq.seq_id)
        tenant = seq.tenant
        self.weights[tenant] = seq.weight
        if self.active[tenant] == 0:
            others = [self.counters.get(t, 0.0) for t, n in self.active.items()
                      if n > 0 and t != tenant]
            own = self.counters.get(tenant, 0.0)
            if others and own < min(others):
                # level with the least served, and first among equals: it has had nothing
                # of this busy period yet
                own = math.nextafter(min(others), -math.inf)
            self.counters[tenant] = own
        self.active[tenant] += 1

    def leave(self, seq: Sequence, now: float = 0.0) -> None:
        if seq.seq_id not in self._live:
            return  # never queued (a request aborted while its adapter was being read)
        self._live.discard(seq.seq_id)
        self.active[seq.tenant] -= 1
        if self.active[seq.tenant] <= 0:
            del self.active[seq.tenant]
            self.last_left[seq.tenant] = now

    def sharing(self, now: float, window_s: float) -> bool:
        """Whether two or more tenants have had work in the engine within `window_s`: a
        tenant between requests (a chat waiting for its user) still counts."""
        for tenant in [t for t, left in self.last_left.items() if now - left > window_s]:
            del self.last_left[tenant]  # gone too long: forget it (the dict stays small)
        return len(set(self.last_left) | set(self.active)) >= 2

    def seat_share(self, tenant: str | None, seats: int) -> float:
        """`tenant`'s weighted part of `seats` among the tenants with work."""
        total = sum(self.weights.get(t, 1.0) for t in self.active)
        return seats * self.weights.get(tenant, 1.0) / total if total else float(seats)

    def charge(self, seq: Sequence, num_prompt: int, num_output: int) -> None:
        """Count tokens computed for `seq`'s tenant this step."""
        self.tokens[seq.tenant] += num_prompt + num_output
        cost = self.prompt_weight * num_prompt + self.output_weight * num_output
        self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + cost / seq.weight

    def counter(self, seq: Sequence) -> float:
        return self.counters.get(seq.tenant, 0.0)

    def shares(self) -> dict[str | None, float]:
        """Each active tenant's service so far relative to the least served (for /stats)."""
        live = {t: self.counters.get(t, 0.0) for t in self.active}
        low = min(live.values(), default=0.0)
        return {t: c - low for t, c in live.items()}


class FairQueue:
    """Waiting sequences: the least-served tenant first; within a tenant, higher priority,
    then arrival (the FCFS queue's order). Background sequences (`Sequence.is_background`)
    come after every foreground one, whatever the tenants' counters: a batch tenant's lines
    never go ahead of live traffic. Same methods as `PriorityFCFSQueue`."""

    def __init__(self, share: FairShare) -> None:
        self.share = share
        self._heaps: dict[str | None, list[tuple[tuple[int, int, int], Sequence]]] = {}
        self._size = 0

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heaps.setdefault(seq.tenant, []), (seq.sort_key, seq))
        self._size += 1

    def peek(self) -> Sequence:
        heads = [heap[0] for heap in self._heaps.values()]
        if not heads:
            raise IndexError("peek from an empty queue")
        return min(heads, key=lambda head: self._order(*head))[1]

    def _order(self, key: tuple[int, int, int], seq: Sequence
               ) -> tuple[bool, float, tuple[int, int, int]]:
        """Admission order: foreground first, then least served, then the tenant's order.
        A tenant's head is background only when it has no foreground request waiting, since
        background is the lowest priority."""
        return (seq.is_background, self.share.counter(seq), key)

    def pop(self) -> Sequence:
        seq = self.peek()
        heap = self._heaps[seq.tenant]
        heapq.heappop(heap)
        if not heap:
            del self._heaps[seq.tenant]
        self._size -= 1
        return seq

    def remove(self, seq: Sequence) -> bool:
        heap = self._heaps.get(seq.tenant, [])
        for i, (_, item) in enumerate(heap):
            if item is seq:
                heap.pop(i)
                heapq.heapify(heap)
                if not heap:
                    del self._heaps[seq.tenant]
                self._size -= 1
                return True
        return False

    def candidates(self, ceiling: Callable[[str | None], float], per_tenant: int
                   ) -> list[Sequence]:
        """The first `per_tenant` waiting requests of each tenant whose counter is at most
        `ceiling(tenant)`, least-served tenant first (for interjections: without sorting the
        whole queue)."""
        picked = []
        for tenant, heap in self._heaps.items():
            counter = self.share.counters.get(tenant, 0.0)
            if heap and counter <= ceiling(tenant):
                picked.extend((counter, key, seq) for key, seq in heapq.nsmallest(per_tenant, heap))
        picked.sort(key=lambda entry: entry[:2])
        return [seq for _, _, seq in picked]

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Sequence]:
        """In admission order if nothing were charged meanwhile (for inspection)."""
        entries = [entry for heap in self._heaps.values() for entry in heap]
        entries.sort(key=lambda entry: self._order(*entry))
        return (seq for _, seq in entries)
