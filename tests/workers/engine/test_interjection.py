"""`Scheduler.schedule_interjection`: a step for requests that arrive while another is in
flight, which must never touch what that step owns."""

from __future__ import annotations

from tests.workers.engine.helpers import make_seq
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import SequenceStatus


def make_scheduler(num_blocks: int = 32, interject: int = 16, max_seqs: int = 8,
                   caching: bool = False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16,
                        interject_tokens=interject),
        BlockManager(num_blocks, 4, enable_caching=caching),
    )


def in_flight(sched: Scheduler, num_prompt: int = 40, tenant: str = "a"):
    """Tenant a's long prompt, its first chunk scheduled: the step in flight."""
    long = make_seq(num_prompt, tenant=tenant)
    sched.add(long)
    out = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in out.chunks] == [(long.seq_id, 16)]
    return long, out


def test_a_short_arrival_of_another_tenant_runs_whole_in_free_blocks():
    sched = make_scheduler()
    long, step = in_flight(sched)
    short = make_seq(6, tenant="b")
    sched.add(short)
    out = sched.schedule_interjection(step)
    assert [(c.seq_id, c.start_pos, c.num_tokens, c.num_samples) for c in out.chunks] == [
        (short.seq_id, 0, 6, 1)]
    assert short.block_table == [4, 5]  # past the step in flight's four
    assert long.block_table == [0, 1, 2, 3] and long.num_computed_tokens == 16
    assert short.status is SequenceStatus.RUNNING and not sched.waiting
    assert [s.seq_id for s in sched.running] == [long.seq_id, short.seq_id]
    assert sched.share.tokens["b"] == 6


def test_a_tenant_alone_in_the_step_in_flight_waits_for_its_end():
    sched = make_scheduler()
    _, step = in_flight(sched)
    own = make_seq(6, tenant="a")
    sched.add(own)
    assert sched.schedule_interjection(step).chunks == []
    assert own.status is SequenceStatus.WAITING and own.block_table == []
    assert list(sched.waiting) == [own]


def test_a_prompt_over_the_limit_waits_for_the_next_step():
    sched = make_scheduler(interject=16)
    _, step = in_flight(sched)
    longer = make_seq(17, tenant="b")
    sched.add(longer)
    assert sched.schedule_interjection(step).chunks == []
    assert longer.block_table == [] and longer.num_computed_tokens == 0
    out = sched.schedule()  # the next ordinary step admits it as usual
    assert longer.seq_id in [c.seq_id for c in out.chunks]


def test_waiting_requests_share_the_limit_least_served_first():
    """b, c and d arrive in that order, each lifted to just under the least served active
    counter, so d is least served, then c: their 6 and 8 tokens fit the 16, b's 10 do not."""
    sched = make_scheduler(interject=16)
    _, step = in_flight(sched)
    b, c, d = (make_seq(n, tenant=t) for n, t in ((10, "b"), (8, "c"), (6, "d")))
    for seq in (b, c, d):
        sched.add(seq)
    out = sched.schedule_interjection(step)
    assert [(ch.seq_id, ch.num_tokens) for ch in out.chunks] == [(d.seq_id, 6), (c.seq_id, 8)]
    assert b.status is SequenceStatus.WAITING and list(sched.waiting) == [b]


def test_no_one_is_preempted_for_an_interjection():
    sched = make_scheduler(num_blocks=5)
    long, step = in_flight(sched)  # holds four of the five blocks
    short = make_seq(6, tenant="b")  # needs two
    sched.add(short)
    out = sched.schedule_interjection(step)
    assert out.chunks == [] and out.preempted_seq_ids == []
    assert sched.running == [long] and long.block_table == [0, 1, 2, 3]
    assert short.block_table == [] and sched.block_manager.num_free_blocks == 1


def test_a_seatless_tenant_may_take_one_seat_past_the_cap():
    """The only seat is a's: b and c, with none, each interject one request past
    max_num_seqs; b's second waits, and the next step admits nothing new."""
    sched = make_scheduler(max_seqs=1)
    long, step = in_flight(sched)
    b1, b2, c = make_seq(4, tenant="b"), make_seq(4, tenant="b"), make_seq(4, tenant="c")
    for seq in (b1, b2, c):
        sched.add(seq)
    out = sched.schedule_interjection(step)
    assert sorted(ch.seq_id for ch in out.chunks) == sorted([b1.seq_id, c.seq_id])
    assert len(sched.running) == 3 and list(sched.waiting) == [b2]
    assert sched.schedule().chunks[0].seq_id == long.seq_id  # nothing new is admitted
    assert list(sched.waiting) == [b2]


def test_a_tenant_at_its_seat_share_does_not_go_past_the_cap():
    """Two seats, two tenants of equal weight: b's share is one seat, which it holds."""
    sched = make_scheduler(max_seqs=2)
    _, step = in_flight(sched)
    seated = make_seq(4, tenant="b")
    sched.add(seated)
    sched.schedule()  # b's first request takes the second seat (a's prefill is held back)
    assert len(sched.running) == 2
    more = make_seq(4, tenant="b")
    sched.add(more)
    assert sched.schedule_interjection(step).chunks == []


def test_an_interjection_reuses_cached_prefix_blocks():
    sched = make_scheduler(caching=True)
    done = make_seq(9, tenant="b")
    done.cache_salt = "b"
    sched.add(done)
    sched.schedule()
    sched.finish(done)  # its two full blocks stay cached under salt b
    _, step = in_flight(sched)
    again = make_seq(9, tenant="b")
    again.cache_salt = "b"
    sched.add(again)
    out = sched.schedule_interjection(step)
    assert [(c.start_pos, c.num_tokens) for c in out.chunks] == [(8, 1)]
    assert again.block_table == [0, 1, 7] and again.num_cached_tokens == 8


def test_a_tenant_ahead_of_the_step_by_more_than_the_limit_waits():
    """a was charged 16 for its chunk; with a limit of 16, b may interject while its
    counter is at most 32: interjecting again and again cannot outrun a fair share."""
    sched = make_scheduler(interject=16)
    _, step = in_flight(sched)
    ahead, level = make_seq(4, tenant="b"), make_seq(4, tenant="c")
    sched.share.counters.update(b=32.5, c=32.0)
    for seq in (ahead, level):
        sched.add(seq)
    out = sched.schedule_interjection(step)
    assert [c.seq_id for c in out.chunks] == [level.seq_id]


def test_a_tenant_in_the_step_beside_another_interjects_within_the_lag():
    """The step holds a's prefill and b's decode: b's new request interjects while b is at
    most 16 ahead of a; a's, ahead of b by more, does not."""
    sched = make_scheduler(interject=16)
    b, a = make_seq(4, tenant="b"), make_seq(40, tenant="a")
    sched.add(b)
    sched.add(a)
    assert [c.num_tokens for c in sched.schedule().chunks] == [4, 12]
    b.token_ids.append(7)
    step = sched.schedule()
    assert [(c.seq_id, c.num_tokens) for c in step.chunks] == [(b.seq_id, 1), (a.seq_id, 15)]
    assert sched.share.counters == {"a": 27.0, "b": 6.0}
    b2, a2 = make_seq(4, tenant="b"), make_seq(4, tenant="a")
    sched.add(b2)
    sched.add(a2)
    out = sched.schedule_interjection(step)
    assert [c.seq_id for c in out.chunks] == [b2.seq_id]
    assert list(sched.waiting) == [a2]


def test_a_tenant_below_its_seat_share_fills_up_to_it_past_the_cap():
    """Four seats: a holds three, b one. Equal weights make b's share two, so b's next
    request interjects as a fifth; a's, over its share, and b's third, at it, wait."""
    sched = make_scheduler(max_seqs=4)
    a_seqs = [make_seq(4, tenant="a") for _ in range(3)]
    b1 = make_seq(4, tenant="b")
    for seq in (*a_seqs, b1):
        sched.add(seq)
    assert len(sched.schedule().chunks) == 4
    for seq in (*a_seqs, b1):
        seq.token_ids.append(7)
    step = sched.schedule()  # four decodes
    b2, b3, a4 = make_seq(4, tenant="b"), make_seq(4, tenant="b"), make_seq(4, tenant="a")
    for seq in (b2, b3, a4):
        sched.add(seq)
    out = sched.schedule_interjection(step)
    assert [c.seq_id for c in out.chunks] == [b2.seq_id]
    assert len(sched.running) == 5 and set(sched.waiting) == {b3, a4}
