from tests.workers.engine.helpers import make_seq
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import SequenceStatus


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
    cap: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                        long_prefill_token_threshold=cap),
        BlockManager(num_blocks, block_size),
    )


def decode(sched: Scheduler, out, token: int = 7) -> None:
    """What the engine does after a step: append a sampled token where a sample was drawn."""
    seqs = {s.seq_id: s for s in sched.running}
    for chunk in out.chunks:
        if chunk.num_samples:
            seqs[chunk.seq_id].token_ids.append(token)


def test_prompts_are_admitted_fcfs_under_the_token_budget():
    sched = make_scheduler(budget=20)
    a, b, c = make_seq(8), make_seq(8), make_seq(8)
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()
    assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        (a.seq_id, 0, 8), (b.seq_id, 0, 8), (c.seq_id, 0, 4),
    ]
    assert out.num_batched_tokens == 20
    assert [ch.num_samples for ch in out.chunks] == [1, 1, 0]  # c's prompt is not done
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4])
    assert c.num_computed_tokens == 4


def test_decodes_go_first_then_prefill_chunks():
    sched = make_scheduler(budget=10)
    a = make_seq(4)
    sched.add(a)
    out = sched.schedule()
    decode(sched, out)
    long = make_seq(30)
    sched.add(long)
    out = sched.schedule()
    # a decodes one token, the long prompt gets the remaining 9 of the budget
    assert [(ch.seq_id, ch.num_tokens) for ch in out.chunks] == [(a.seq_id, 1), (long.seq_id, 9)]
    out = sched.schedule()
    assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        (long.seq_id, 9, 10)
    ]  # a sampled nothing new: it waits for its token from the engine
    decode(sched, out)


def test_chunked_prefill_continues_where_it_stopped_and_samples_at_the_end():
    sched = make_scheduler(budget=4)
    seq = make_seq(10)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks += [(ch.start_pos, ch.token_ids, ch.num_samples) for ch in out.chunks]
    assert chunks == [
        (0, [1, 2, 3, 4], 0),
        (4, [5, 6, 7, 8], 0),
        (8, [9, 10], 1),
    ]
    assert seq.block_table == [0, 1, 2]


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_seqs=2)
    seqs = [make_seq(4) for _ in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert [ch.seq_id for ch in out.chunks] == [seqs[0].seq_id, seqs[1].seq_id]
    assert len(sched.waiting) == 1


def test_preemption_takes_the_newest_and_recomputes_it_later():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    old, new = make_seq(7), make_seq(7)
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    assert (old.block_table, new.block_table) == ([0, 1], [2, 3])
    decode(sched, out)  # both now have 8 tokens: the 8th still fits block 1 / block 3
    out = sched.schedule()
    assert out.preempted_seq_ids == []
    decode(sched, out)  # 9 tokens each: both need a third block, the pool has none
    out = sched.schedule()
    assert out.preempted_seq_ids == [new.seq_id]
    assert [(ch.seq_id, ch.num_tokens) for ch in out.chunks] == [(old.seq_id, 1)]
    assert old.block_table == [0, 1, 3]
    assert new.status is SequenceStatus.WAITING
    assert new.block_table == [] and new.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    # old finishes: new is recomputed from scratch, prompt and generated tokens alike
    sched.finish(old)
    out = sched.schedule()
    assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        (new.seq_id, 0, 9)
    ]
    assert out.chunks[0].token_ids == [1, 2, 3, 4, 5, 6, 7, 7, 7]
    assert out.finished_seq_ids == [old.seq_id]


def test_a_lone_sequence_that_cannot_grow_preempts_itself_without_deadlock():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=64)
    seq = make_seq(8)
    sched.add(seq)
    out = sched.schedule()
    decode(sched, out)
    out = sched.schedule()  # the 9th token needs a third block that does not exist
    assert out.chunks == [] and out.preempted_seq_ids == [seq.seq_id]
    assert sched.block_manager.num_free_blocks == 2


def test_priority_orders_admission_and_fcfs_within_a_priority():
    sched = make_scheduler(budget=4, max_seqs=8)
    low, high1, high2 = make_seq(4, priority=5), make_seq(4, priority=0), make_seq(4, priority=0)
    for seq in (low, high1, high2):
        sched.add(seq)
    order = []
    for _ in range(3):
        out = sched.schedule()
        order += [ch.seq_id for ch in out.chunks if ch.start_pos == 0]
    assert order == [high1.seq_id, high2.seq_id, low.seq_id]


def test_high_priority_arrival_preempts_lower_priority_running_work():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    low = make_seq(12, priority=5)
    sched.add(low)
    sched.schedule()
    assert low.block_table == [0, 1, 2]
    urgent = make_seq(8, priority=0)
    sched.add(urgent)
    out = sched.schedule()
    assert low.seq_id in out.preempted_seq_ids
    assert [ch.seq_id for ch in out.chunks] == [urgent.seq_id]
    assert urgent.block_table == [3, 2]


def test_fork_shares_the_prompt_and_all_blocks_come_back():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    parent = make_seq(6, n=3)
    sched.add(parent)
    out = sched.schedule()
    assert out.chunks[0].num_samples == 3
    children = [make_seq(6, seq_id=1000 + i) for i in range(2)]
    parent.pending_forks = 0
    for child in children:
        sched.fork(parent, child)
    assert all(c.block_table == [0, 1] for c in children)
    assert sched.block_manager.ref_counts[:2] == [3, 3]
    for seq in (parent, *children):
        seq.token_ids.append(9)
    out = sched.schedule()
    # parent and first child copy the shared tail; the last holder writes in place
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [s.block_table for s in (parent, *children)] == [[0, 2], [0, 3], [0, 1]]
    for seq in (parent, *children):
        sched.finish(seq)
    assert sched.block_manager.num_free_blocks == 16
    assert not sched.has_work


def test_finish_of_a_waiting_sequence_removes_it():
    sched = make_scheduler()
    seq = make_seq(4)
    sched.add(seq)
    sched.finish(seq)
    assert len(sched.waiting) == 0
    assert sched.schedule().chunks == []


def test_lora_cap_passes_over_requests_whose_adapter_does_not_fit():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_loras=2),
                      BlockManager(64, 4))
    seqs = [make_seq(4) for _ in range(5)]
    for seq, lora_id in zip(seqs, [1, 2, 3, 1, None], strict=True):
        seq.lora_id = lora_id
        sched.add(seq)
    out = sched.schedule()
    admitted = [c.seq_id for c in out.chunks]
    assert admitted == [seqs[0].seq_id, seqs[1].seq_id, seqs[3].seq_id, seqs[4].seq_id]
    assert [c.lora_id for c in out.chunks] == [1, 2, 1, None]
    assert list(sched.waiting) == [seqs[2]] and sched.active_loras() == {1, 2}
    for seq in (seqs[1],):
        sched.finish(seq)
    out = sched.schedule()  # adapter 2 is gone: 3 fits now
    assert seqs[2].seq_id in [c.seq_id for c in out.chunks]
    assert sched.active_loras() == {1, 3}


def test_pinned_adapters_count_against_the_cap():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_loras=2),
                      BlockManager(64, 4), pinned_loras={9})
    a, b = make_seq(4), make_seq(4)
    a.lora_id, b.lora_id = 1, 2
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [c.seq_id for c in out.chunks] == [a.seq_id]  # 1 plus pinned 9 fill both slots


def capped_scheduler(budget: int = 32, cap: int = 8) -> Scheduler:
    return make_scheduler(budget=budget, cap=cap)


def test_a_long_prompt_alone_is_capped_too():
    """No step is longer than one capped chunk, so a request arriving during it waits at
    most that long."""
    sched = capped_scheduler()
    long = make_seq(40)
    sched.add(long)
    out = sched.schedule()
    assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        (long.seq_id, 0, 8)]
    out = sched.schedule()
    assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        (long.seq_id, 8, 8)]


def test_a_long_prompt_is_capped_while_a_short_one_waits_and_both_advance():
    sched = capped_scheduler()
    long, short = make_seq(40), make_seq(3)
    sched.add(long)
    for _ in range(4):  # alone: capped chunks, 32 tokens in four steps
        sched.schedule()
    sched.add(short)
    out = sched.schedule()
    # long gets the cap, and short is admitted in the same step
    assert [(ch.seq_id, ch.start_pos, ch.num_tokens, ch.num_samples) for ch in out.chunks] == [
        (long.seq_id, 32, 8, 1), (short.seq_id, 0, 3, 1)]
    assert (long.block_table, short.block_table) == ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10])


def test_two_long_prompts_share_the_step_in_capped_chunks():
    sched = capped_scheduler(budget=20, cap=8)
    a, b = make_seq(30), make_seq(30)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        (a.seq_id, 0, 8), (b.seq_id, 0, 8)]
    out = sched.schedule()
    assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
        (a.seq_id, 8, 8), (b.seq_id, 8, 8)]


def test_decodes_are_never_affected_by_the_cap():
    sched = capped_scheduler(budget=32, cap=2)
    a = make_seq(2)
    sched.add(a)
    out = sched.schedule()
    decode(sched, out)
    b = make_seq(10)
    sched.add(b)
    out = sched.schedule()
    assert [(ch.seq_id, ch.num_tokens) for ch in out.chunks] == [(a.seq_id, 1), (b.seq_id, 2)]


def test_running_prefills_leave_room_for_a_waiting_request():
    sched = capped_scheduler(budget=20, cap=8)
    longs = [make_seq(40) for _ in range(3)]
    for seq in longs:
        sched.add(seq)
    sched.schedule()  # admitted: 8 + 8, and the third gets the last 4
    short = make_seq(3)
    sched.add(short)
    out = sched.schedule()
    # room for prefills is 20 - 8 = 12: the first long takes 8, the second 4, the third none,
    # and the short one is admitted in the same step
    assert [(ch.seq_id, ch.num_tokens) for ch in out.chunks] == [
        (longs[0].seq_id, 8), (longs[1].seq_id, 4), (short.seq_id, 3)]
