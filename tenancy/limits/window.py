"""A sliding rate window of one-second buckets that never lets a 60 s span exceed its limit.

An entry recorded in bucket ``b`` (wall-clock second ``b``) may have happened as late as
``b + 1``, so it keeps counting until ``b + 61``: 61 buckets are live at once. That makes the
window exact on the safe side (an entry ages out between 60 and 61 s after it was made) with
memory bounded by 61 counters per scope. The Redis script implements the same rule.
"""

from __future__ import annotations

import math

WINDOW_S = 60


def oldest_live_bucket(now: float) -> int:
    """The oldest bucket that still counts at time ``now``."""
    return math.floor(now) - WINDOW_S


def ages_out_at(bucket: int) -> float:
    """When an entry recorded in ``bucket`` stops counting."""
    return float(bucket + WINDOW_S + 1)


class BucketWindow:
    """Amounts per one-second bucket; the in-process twin of the Redis hash."""

    __slots__ = ("_buckets",)

    def __init__(self) -> None:
        self._buckets: dict[int, int] = {}

    def prune(self, now: float) -> None:
        """Forget buckets that no longer count, so memory stays at most 61 entries."""
        oldest = oldest_live_bucket(now)
        for bucket in [b for b in self._buckets if b < oldest]:
            del self._buckets[bucket]

    def total(self) -> int:
        return sum(self._buckets.values())

    def newest(self) -> int | None:
        return max(self._buckets, default=None)

    def is_empty(self) -> bool:
        return not self._buckets

    def add(self, bucket: int, amount: int) -> None:
        if amount:
            self._buckets[bucket] = self._buckets.get(bucket, 0) + amount

    def adjust(self, bucket: int, delta: int, now: float) -> None:
        """Reconcile an earlier entry, if its bucket still counts; never below zero."""
        if bucket < oldest_live_bucket(now) or bucket not in self._buckets:
            return
        left = self._buckets[bucket] + delta
        if left > 0:
            self._buckets[bucket] = left
        else:
            del self._buckets[bucket]

    def wait_for(self, excess: int, now: float) -> float:
        """Seconds until at least ``excess`` units have aged out (a full window if never)."""
        freed = 0
        for bucket in sorted(self._buckets):
            freed += self._buckets[bucket]
            if freed >= excess:
                return ages_out_at(bucket) - now
        return float(WINDOW_S)
