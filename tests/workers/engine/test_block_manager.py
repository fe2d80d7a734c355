from tests.workers.engine.helpers import make_seq
from workers.engine.block_manager import BlockManager


def test_allocate_grows_block_table_in_free_list_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(10)
    assert bm.blocks_needed(seq, 10) == 3
    assert bm.can_allocate_slots(seq, 10)
    assert bm.allocate_slots(seq, 10) == []
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    # tokens 10 and 11 still fit in block 2; the 13th needs block 3
    assert bm.blocks_needed(seq, 2) == 0
    bm.allocate_slots(seq, 3)
    assert seq.block_table == [0, 1, 2, 3]


def test_can_allocate_respects_pool_and_reserve():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(16)
    assert bm.can_allocate_slots(seq, 16)
    assert not bm.can_allocate_slots(seq, 17)
    assert not bm.can_allocate_slots(seq, 16, reserve=1)


def test_free_returns_every_block_and_resets_progress():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(8), make_seq(5)
    bm.allocate_slots(a, 8)
    bm.allocate_slots(b, 5)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    a.num_computed_tokens = 8
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 4
    assert list(bm.free_block_ids) == [4, 5, 1, 0]
    bm.free(b)
    assert bm.num_free_blocks == 6
    assert bm.ref_counts == [0] * 6


def test_fork_shares_blocks_and_copies_partial_tail_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = make_seq(6), make_seq(6)
    bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    bm.fork(parent, child)
    assert child.block_table == [0, 1]
    assert child.num_computed_tokens == 6
    assert bm.ref_counts[:2] == [2, 2]
    assert bm.num_free_blocks == 6
    # position 6 lands in shared block 1 (half full): copy on write
    assert bm.blocks_needed(parent, 1) == 1
    assert bm.allocate_slots(parent, 1) == [(1, 2)]
    assert parent.block_table == [0, 2]
    assert bm.ref_counts[:3] == [2, 1, 1]
    # the child is now the only holder of block 1 and writes in place
    assert bm.allocate_slots(child, 1) == []
    assert child.block_table == [0, 1]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8
    assert bm.ref_counts == [0] * 8


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = make_seq(8), make_seq(8)
    bm.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    bm.fork(parent, child)
    assert bm.allocate_slots(parent, 1) == []
    assert bm.allocate_slots(child, 1) == []
    assert parent.block_table == [0, 1, 2]
    assert child.block_table == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
