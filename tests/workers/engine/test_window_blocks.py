"""Blocks wholly before a sliding window are given back as a sequence is scheduled, where
every layer attends within the window (`BlockManager(window=...)`); prefix caching, forks and
preemption stay correct."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import make_seq
from workers.engine.block_manager import RELEASED, BlockManager
from workers.engine.scheduler import Scheduler, SchedulerConfig


def step(bm: BlockManager, seq, num_new: int) -> None:
    """Schedule `num_new` tokens of `seq` and pretend the runner computed them."""
    bm.allocate_slots(seq, num_new)
    seq.num_computed_tokens += num_new


def test_blocks_before_the_next_positions_window_are_given_back():
    bm = BlockManager(num_blocks=16, block_size=4, window=8)
    seq = make_seq(40)
    step(bm, seq, 12)  # positions 0-11
    assert RELEASED not in seq.block_table and bm.num_free_blocks == 13
    # position 12 sees 5-12: block 0 (0-3) is wholly before it, block 1 (4-7) is not
    step(bm, seq, 8)
    assert seq.block_table[:2] == [RELEASED, 1] and bm.num_free_blocks == 12
    # position 20 sees 13-20: blocks 0-2 before it
    bm.allocate_slots(seq, 1)
    assert seq.block_table[:4] == [RELEASED] * 3 + [3]
    assert bm.num_free_blocks == 16 - 3  # blocks 3, 4 held and a sixth for position 20
    bm.free(seq)
    assert bm.num_free_blocks == 16 and bm.ref_counts == [0] * 16


def test_without_a_window_nothing_is_given_back():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(40)
    step(bm, seq, 32)
    bm.allocate_slots(seq, 4)
    assert RELEASED not in seq.block_table
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=4, window=0)


def test_a_long_sequence_holds_about_a_window_of_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, window=10)
    seq = make_seq(200, max_tokens=1)
    for _ in range(25):  # 200 positions in chunks of 8, on a pool of 32 positions
        step(bm, seq, 8)
        held = [b for b in seq.block_table if b != RELEASED]
        assert len(held) <= 10 // 4 + 3
    assert seq.block_table.count(RELEASED) == 50 - 5


def test_given_back_blocks_stay_cached_for_the_same_prefix():
    """Named before they are let go of: a second request with the prompt hits all of them."""
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True, window=6)
    a = make_seq(30)
    for _ in range(3):
        step(bm, a, 10)
    # scheduled last at 20, which sees 15-20: blocks 0-2 given back
    assert a.block_table[:4] == [RELEASED] * 3 + [3]
    bm.allocate_slots(a, 1)  # the next step names blocks 0-6 and gives back 0-5 (30 sees 25-)
    assert a.block_table[:7] == [RELEASED] * 6 + [6]
    b = make_seq(30)
    assert bm.match_prefix(b) == 28  # every full block of the prompt but the last token's
    assert RELEASED not in b.block_table
    bm.allocate_slots(b, 2)  # b computes from 28 on: its own blocks before 23 go back
    assert b.block_table[:5] == [RELEASED] * 5
    bm.free(a)
    bm.free(b)
    assert bm.ref_counts == [0] * 32


def test_forks_share_what_is_held_and_free_cleanly():
    bm = BlockManager(num_blocks=16, block_size=4, window=4)
    parent = make_seq(20, n=2)
    step(bm, parent, 20)
    bm.allocate_slots(parent, 1)  # position 20 sees 17-20: blocks 0-3 go back
    child = make_seq(20)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert child.block_table[:4] == [RELEASED] * 4
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 16 and bm.ref_counts == [0] * 16


def test_scheduler_runs_a_long_prompt_and_decodes_in_a_small_pool():
    """A prompt of 3x the pool runs through chunked prefill and decodes, giving blocks back
    as it goes; preempted, it starts over from position 0 with a whole table."""
    bm = BlockManager(num_blocks=6, block_size=4, window=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8), bm)
    seq = make_seq(72, max_tokens=4)
    sched.add(seq)
    starts = []
    while seq.num_computed_tokens < 72:
        out = sched.schedule()
        assert out.preempted_seq_ids == []
        starts += [c.start_pos for c in out.chunks]
        for chunk in out.chunks:  # what each chunk reads is still held
            first = max(chunk.start_pos - 8 + 1, 0) // 4
            assert RELEASED not in chunk.block_table[first:]
    assert starts == list(range(0, 72, 8))
    seq.token_ids.append(7)  # sampled
    sched.schedule()
    assert sum(b != RELEASED for b in seq.block_table) <= 4
    out = sched.schedule()  # no room is needed, so nothing was preempted
    assert out.preempted_seq_ids == []
    sched.running.remove(seq)
    sched._preempt(seq, out)
    assert seq.block_table == [] and bm.num_free_blocks == 6


def test_blocks_about_to_be_given_back_count_as_room():
    """A full pool: the next chunk fits in what it gives back, unless another sequence
    holds those blocks too."""
    bm = BlockManager(num_blocks=4, block_size=4, window=4)
    seq = make_seq(40)
    step(bm, seq, 16)
    assert bm.num_free_blocks == 0
    assert bm.can_allocate_slots(seq, 4)  # 16 sees 13-16: blocks 0-2 go back first
    child = make_seq(16)
    bm.fork(seq, child)
    assert not bm.can_allocate_slots(seq, 4)
    bm.free(child)
    bm.allocate_slots(seq, 4)
    assert seq.block_table == [RELEASED] * 3 + [3, 2]  # the latest let go of is taken first
