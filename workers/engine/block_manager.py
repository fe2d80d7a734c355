"""Fixed pool of KV blocks: free list, ref counts, copy-on-write, and automatic prefix caching.

Pure Python. Sharing (n > 1 forks, and prompt prefixes across requests) is expressed with ref
counts: a block is reusable only when its count reaches zero.

Prefix caching: a full block is named by a chain hash of (parent hash, its token ids, cache
salt, adapter id). Once computed it is registered under that hash. A freed block keeps its
name while it waits on the free list, oldest-freed first out (LRU), so a later request with
the same prefix, salt and adapter takes it back instead of recomputing. A hit is verified
against the stored key, so a hash collision can never serve wrong KV, and a different salt
(tenant) or adapter never hits.

Sliding windows: where every layer that reads the pool attends within `window` positions
(Mistral; not Gemma 2 or 3, whose global layers read everything), a sequence gives back the
blocks wholly before the window of the next position it computes, as it is scheduled: its
table keeps their places as `RELEASED`, so positions still map to `table[pos // block_size]`.
A block is named (prefix caching) before it is let go of, and a named block waits on the
free list like any other, so a later request with the same prefix still hits it: its K/V
depend on the tokens up to it only, not on what was kept of the sequence after.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from workers.engine import prefix_hash
from workers.engine.prefix_hash import BlockKey, PrefixSummary
from workers.engine.sequence import Sequence

RELEASED = -1  # a table entry whose block was given back (wholly before the window)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = False,
                 window: int | None = None) -> None:
        """`window`: every layer reading the pool sees only the `window` most recent
        positions (HF's `sliding_window`), so blocks before them can be given back; None
        where some layer (or a draft model sharing the tables) reads whole contexts."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if window is not None and window < 1:
            raise ValueError("window must be positive")
        self.window = window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # Insertion-ordered: blocks are taken from the front, freed blocks go to the back.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.block_keys: dict[int, tuple[int, BlockKey]] = {}  # block id -> (hash, key)
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0
        self.last_used = [0.0] * num_blocks  # time.monotonic() a sequence last held it

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences (cached but unused blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def hot_blocks(self, window_s: float, now: float | None = None) -> int:
        """The pool's working set: blocks held by sequences, and cached blocks a sequence let
        go of within the last `window_s` (a chat's next turn is likely to want them back).
        Routing compares it with the pool to place new prompts where they evict nothing.
        Free blocks join the free list's back as they are let go of, so the list is in
        `last_used` order: the walk from the back stops at the first block older than the
        window, and a call costs the recently freed blocks, not the pool (a /stats poll on a
        pool of 100k blocks)."""
        since = (time.monotonic() if now is None else now) - window_s
        used, named = self.last_used, self.block_keys
        recent = 0
        for b in reversed(self.free_block_ids):
            if used[b] < since:
                break
            recent += b in named
        return self.num_blocks - self.num_free_blocks + recent

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks to hold `num_new_tokens` more, counting a copy of a shared tail."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size) - len(seq.block_table)
        return max(needed, 0) + (1 if self._tail_needs_copy(seq) else 0)

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Whether the pool has the blocks, counting those `allocate_slots` gives back first
        (before the window) that no other sequence holds."""
        free = self.num_free_blocks
        if self.window is not None:
            table = seq.block_table
            free += sum(self.ref_counts[table[i]] == 1 for i in self._before_window(seq))
        return self.blocks_needed(seq, num_new_tokens) + reserve <= free

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Grow the block table; return (src, dst) KV copies the runner must do first."""
        if self.enable_caching:
            self._register_computed(seq)
        if self.window is not None:
            self._release_before_window(seq)
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

    def match_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks of its longest cached prefix; tokens reused.

        At least the last prompt token is left to compute, so there is a position to sample
        from and no write ever lands in a shared block.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_caching:
            return 0
        self._extend_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        self.num_queried_tokens += seq.num_tokens
        for i, block_hash in enumerate(seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]):
            block_id = self.cached.get(block_hash)
            if block_id is None or self.block_keys[block_id][1] != self._key(seq, i):
                break
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.num_hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of the parent with the child."""
        for block_id in parent.block_table:
            if block_id != RELEASED:
                self.ref_counts[block_id] += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens: the tail a speculative step
        wrote for proposals the model rejected. Names are untouched: only blocks of computed,
        kept tokens are ever named (`_register_computed`)."""
        keep = -(-seq.num_tokens // self.block_size)
        now = time.monotonic()
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            self.last_used[block_id] = now  # keeps the free list in last_used order
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks no one holds go back to the pool."""
        if self.enable_caching:
            self._register_computed(seq)
        now = time.monotonic()
        for block_id in reversed(seq.block_table):
            if block_id != RELEASED:
                self._let_go(block_id, now)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _let_go(self, block_id: int, now: float) -> None:
        self.last_used[block_id] = now
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids[block_id] = None

    def _before_window(self, seq: Sequence) -> list[int]:
        """The held blocks wholly before the first position the next computed one sees
        (`num_computed_tokens - window + 1`; later positions see even less), by index.
        Released entries form a prefix of the table, so the walk back stops at the first."""
        assert self.window is not None
        first = seq.num_computed_tokens - self.window + 1
        indices = []
        for index in range(min(first // self.block_size, len(seq.block_table)) - 1, -1, -1):
            if seq.block_table[index] == RELEASED:
                break
            indices.append(index)
        return indices

    def _release_before_window(self, seq: Sequence) -> None:
        now = time.monotonic()
        for index in self._before_window(seq):
            self._let_go(seq.block_table[index], now)
            seq.block_table[index] = RELEASED

    def _register_computed(self, seq: Sequence) -> None:
        """Name every full block whose tokens are computed, so later requests can reuse it."""
        num_full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, num_full)
        for i in range(num_full):
            block_id = seq.block_table[i]
            block_hash = seq.block_hashes[i]
            if block_id == RELEASED or block_id in self.block_keys or block_hash in self.cached:
                continue  # given back (named before), already named, or cached already
            self.cached[block_hash] = block_id
            self.block_keys[block_id] = (block_hash, self._key(seq, i))

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        while len(seq.block_hashes) < num_blocks:
            seq.block_hashes.append(prefix_hash.block_hash(self._key(seq, len(seq.block_hashes))))

    def summary(self) -> PrefixSummary:
        """A Bloom filter of the cached blocks' names, for routing (safe from another thread:
        the copy of the names is one C-level list() under the GIL)."""
        names = list(self.cached)
        return PrefixSummary.build(names, self.block_size, capacity=len(names))

    def _key(self, seq: Sequence, index: int) -> BlockKey:
        parent = seq.block_hashes[index - 1] if index > 0 else None
        start = index * self.block_size
        tokens = tuple(seq.token_ids[start : start + self.block_size])
        return parent, tokens, seq.cache_salt, seq.lora_id

    def _tail_needs_copy(self, seq: Sequence) -> bool:
        """The next write lands in a partly filled block that others also read."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return (
            offset != 0
            and index < len(seq.block_table)
            and self.ref_counts[seq.block_table[index]] > 1
        )

    def _take(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        assert self.ref_counts[block_id] == 0
        named = self.block_keys.pop(block_id, None)
        if named is not None:  # evict: the least recently freed cached block is reused
            del self.cached[named[0]]
        self.ref_counts[block_id] = 1
        return block_id
