"""Prefix caching in the block manager and scheduler: exact block ids, LRU, salts, no leaks."""

from __future__ import annotations

from tests.workers.engine.helpers import make_seq
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler, SchedulerConfig


def computed(bm: BlockManager, seq, salt: str | None = None):
    """Allocate and pretend the runner computed the whole prompt."""
    seq.cache_salt = salt
    bm.match_prefix(seq)
    bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def test_freed_blocks_are_reused_by_the_same_prefix():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    a = computed(bm, make_seq(14))
    assert a.block_table == [0, 1, 2, 3]
    bm.free(a)
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 3, 2, 1, 0]
    b = make_seq(14)
    assert bm.match_prefix(b) == 12  # three full blocks; the partial one is recomputed
    assert b.block_table == [0, 1, 2] and b.num_computed_tokens == 12
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 3]
    assert bm.ref_counts[:3] == [1, 1, 1]


def test_live_blocks_are_shared_and_last_token_is_always_computed():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    a = computed(bm, make_seq(12))
    bm.allocate_slots(a, 1)  # the next step registers a's three computed blocks
    b = make_seq(12)
    # Only two blocks: the twelfth token must be computed to have a position to sample from.
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.allocate_slots(b, 4)
    assert b.block_table[2] not in a.block_table  # the write lands in b's own block


def test_salt_separates_tenants():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    bm.free(computed(bm, make_seq(9), salt="tenant-a"))
    other = make_seq(9)
    other.cache_salt = "tenant-b"
    assert bm.match_prefix(other) == 0 and other.block_table == []
    same = make_seq(9)
    same.cache_salt = "tenant-a"
    assert bm.match_prefix(same) == 8


def test_a_hash_collision_is_not_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    a = computed(bm, make_seq(9))
    first_block = a.block_table[0]
    bm.free(a)
    b = make_seq(9)
    b.token_ids[0] = 999  # different tokens...
    bm._extend_hashes(b, 2)
    bm.cached[b.block_hashes[0]] = first_block  # ...forced onto a's block, as a collision would
    assert bm.match_prefix(b) == 0  # the stored tokens differ: verified, refused


def test_lru_eviction_takes_the_oldest_freed_block_first():
    bm = BlockManager(num_blocks=4, block_size=4, enable_caching=True)
    old = computed(bm, make_seq(5))  # blocks 0 and 1; block 0 full, gets cached
    bm.free(old)
    new = computed(bm, make_seq(5, seq_id=1000))  # same prefix: takes block 0 back
    assert new.block_table == [0, 2]
    bm.free(new)
    assert list(bm.free_block_ids) == [3, 1, 2, 0]  # least recently freed first
    filler = make_seq(16)
    filler.token_ids = [7] * 16
    bm.allocate_slots(filler, 16)  # needs all four: the cached block 0 goes last, but goes
    assert filler.block_table == [3, 1, 2, 0]
    assert bm.cached == {}
    bm.free(filler)
    assert bm.match_prefix(make_seq(5)) == 0


def test_no_hits_nothing_leaks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    seqs = []
    for i in range(4):
        s = make_seq(10)
        s.token_ids = [100 * (i + 1) + t for t in range(10)]
        seqs.append(computed(bm, s))
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 16 and bm.ref_counts == [0] * 16
    assert len(bm.cached) == 8  # two full blocks each, named but reusable


def test_scheduler_skips_cached_prefix_and_records_it():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    first = make_seq(10)
    sched.add(first)
    out = sched.schedule()
    assert [(c.seq_id, c.start_pos, c.num_tokens) for c in out.chunks] == [(first.seq_id, 0, 10)]
    first.token_ids.append(5)  # sampled
    second = make_seq(10)
    sched.add(second)
    out = sched.schedule()
    chunks = {c.seq_id: (c.start_pos, c.num_tokens) for c in out.chunks}
    assert chunks == {first.seq_id: (10, 1), second.seq_id: (8, 2)}
    assert second.num_cached_tokens == 8 and first.num_cached_tokens == 0
    assert second.block_table[:2] == first.block_table[:2]


def test_the_working_set_is_held_blocks_and_those_let_go_of_recently(monkeypatch):
    """Blocks a sequence holds are hot; a freed cached block stays hot for the window after
    its sequence let go of it; an evicted block (named no more) is not hot, however recent."""
    clock = [100.0]
    monkeypatch.setattr("workers.engine.block_manager.time.monotonic", lambda: clock[0])
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    a = computed(bm, make_seq(14))  # blocks 0-3, held
    assert bm.hot_blocks(10.0) == 4
    bm.free(a)  # 0-2 named (full), 3 a partial block: free and unnamed
    assert bm.hot_blocks(10.0) == 3
    clock[0] = 109.0
    b = make_seq(6)
    b.token_ids[:] = range(50, 56)  # other tokens: fresh blocks 4, 5
    b = computed(bm, b)
    assert b.block_table == [4, 5] and bm.hot_blocks(10.0) == 5
    clock[0] = 111.0  # a's blocks were let go of 11 s ago
    assert bm.hot_blocks(10.0) == 2 and bm.hot_blocks(20.0) == 5
    c = make_seq(14)
    assert bm.match_prefix(c) == 12  # a's prefix taken back: held, so hot again
    assert bm.hot_blocks(10.0) == 5
    bm.free(c)
    bm.free(b)
    assert bm.hot_blocks(10.0) == 4  # a's three full blocks and b's one full block
    for _ in range(8):  # every block taken: the named ones evicted
        bm._take()
    clock[0] = 112.0
    assert bm.hot_blocks(10.0) == 8  # all held now


def test_the_working_set_count_matches_a_walk_of_the_whole_pool(monkeypatch):
    """hot_blocks walks only the recently freed end of the free list; over random takes,
    prefix hits, speculative trims and frees it agrees with counting every block."""
    import random

    rng = random.Random(7)
    clock = [0.0]
    monkeypatch.setattr("workers.engine.block_manager.time.monotonic", lambda: clock[0])
    bm = BlockManager(num_blocks=48, block_size=4, enable_caching=True)

    def brute(window_s: float) -> int:
        since = clock[0] - window_s
        return sum(1 for b in range(bm.num_blocks) if bm.ref_counts[b] > 0
                   or (b in bm.block_keys and bm.last_used[b] >= since))

    live = []
    for step in range(400):
        clock[0] += rng.choice((0.0, 0.5, 2.0))
        op = rng.random()
        if op < 0.4 or not live:
            seq = make_seq(rng.randint(2, 20))
            seq.token_ids[:] = [rng.randint(1, 3) for _ in seq.token_ids]  # shared prefixes
            if bm.can_allocate_slots(seq, seq.num_tokens + 4, reserve=2):
                live.append(computed(bm, seq))
        elif op < 0.6:
            seq = rng.choice(live)
            if bm.can_allocate_slots(seq, 4):
                bm.allocate_slots(seq, 4)  # a speculative step's proposals...
                seq.token_ids.append(1)
                seq.num_computed_tokens += 1
                bm.trim(seq)  # ...of which one was kept
        else:
            bm.free(live.pop(rng.randrange(len(live))))
        for window_s in (0.0, 1.0, 5.0, 100.0):
            assert bm.hot_blocks(window_s) == brute(window_s), (step, window_s)
