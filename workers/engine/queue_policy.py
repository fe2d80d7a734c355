"""The waiting queue: which request is admitted next. A replaceable piece.

Today: strict priority, FCFS within a priority. Per-tenant weighted fair share slots in as
another class with the same four methods. Background sequences (the lowest priority,
`BACKGROUND_PRIORITY`) sort after every foreground one here by priority alone.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from workers.engine.sequence import Sequence


class PriorityFCFSQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], Sequence]] = []

    def push(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.sort_key, seq))

    def peek(self) -> Sequence:
        return self._heap[0][1]

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: Sequence) -> bool:
        for i, (_, item) in enumerate(self._heap):
            if item is seq:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (item for _, item in sorted(self._heap, key=lambda entry: entry[0]))
