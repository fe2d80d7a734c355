"""Fixed pool of KV blocks: free list, ref counts, copy-on-write for shared tails.

Pure Python. Sharing (n > 1 forks today, prefix caching next) is expressed with ref counts:
a block is back on the free list only when its count reaches zero.
"""

from __future__ import annotations

from collections import deque

from workers.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks to hold `num_new_tokens` more, counting a copy of a shared tail."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size) - len(seq.block_table)
        return max(needed, 0) + (1 if self._tail_needs_copy(seq) else 0)

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Grow the block table; return (src, dst) KV copies the runner must do first."""
        copies = []
        if self._tail_needs_copy(seq):
            index = seq.num_computed_tokens // self.block_size
            src = seq.block_table[index]
            dst = self._take()
            self.ref_counts[src] -= 1
            seq.block_table[index] = dst
            copies.append((src, dst))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < total:
            seq.block_table.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of the parent with the child."""
        for block_id in parent.block_table:
            self.ref_counts[block_id] += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks no one holds go back to the pool."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _tail_needs_copy(self, seq: Sequence) -> bool:
        """The next write lands in a partly filled block that others also read."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return (
            offset != 0
            and index < len(seq.block_table)
            and self.ref_counts[seq.block_table[index]] > 1
        )

    def _take(self) -> int:
        block_id = self.free_block_ids.popleft()
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id
