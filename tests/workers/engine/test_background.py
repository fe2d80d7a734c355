"""Background work (`BACKGROUND_PRIORITY`, the batch worker's lines) runs in what foreground
work leaves: admission, the step's budget, seats and blocks, under both policies."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import make_seq
from tests.workers.engine.test_scheduler import decode
from workers.engine.block_manager import BlockManager
from workers.engine.fair_share import FairQueue, FairShare
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import BACKGROUND_PRIORITY, Sequence, SequenceStatus

POLICIES = ("fair", "fcfs")


def make_scheduler(policy: str, num_blocks: int = 64, budget: int = 32, max_seqs: int = 8,
                   **config: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     policy=policy, **config),
                     BlockManager(num_blocks, 4))


def batch_line(num_prompt: int, max_tokens: int = 16) -> Sequence:
    return make_seq(num_prompt, priority=BACKGROUND_PRIORITY, tenant="batch",
                    max_tokens=max_tokens)


def chunks(out) -> list[tuple[int, int, int]]:
    return [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks]


def test_the_gateways_batch_priority_is_the_engines_background_class():
    from gateway.batches.worker import BATCH_PRIORITY

    assert BATCH_PRIORITY == BACKGROUND_PRIORITY == 10
    assert batch_line(4).is_background and not make_seq(4, priority=9).is_background


def test_the_fair_queue_puts_foreground_first_whatever_the_tenants_service():
    share = FairShare()
    queue = FairQueue(share)
    heavy_live, light_batch = make_seq(4, tenant="live"), batch_line(4)
    other_batch = make_seq(4, priority=BACKGROUND_PRIORITY, tenant="batch2")
    for seq in (light_batch, other_batch, heavy_live):
        queue.push(seq)
    share.counters.update(live=1000.0, batch=0.0, batch2=5.0)
    # background ones after, least-served batch tenant first among them
    assert list(queue) == [heavy_live, light_batch, other_batch]
    assert queue.pop() is heavy_live and queue.pop() is light_batch


@pytest.mark.parametrize("policy", POLICIES)
def test_a_foreground_arrival_is_admitted_and_prefilled_in_the_next_step(policy):
    """Three seats, all held by a batch's lines, two more lines waiting; the live tenant has
    been served far more than the batch tenant. Its request takes the newest line's seat and
    prefills in the very next step, ahead of the lines' decodes; no waiting line starts."""
    sched = make_scheduler(policy, max_seqs=3)
    lines = [batch_line(8) for _ in range(5)]
    for seq in lines:
        sched.add(seq)
    out = sched.schedule()
    assert [ch.seq_id for ch in out.chunks] == [s.seq_id for s in lines[:3]]
    decode(sched, out)
    live = make_seq(12, tenant="live")
    sched.add(live)
    sched.share.counters["live"] = 1000.0
    out = sched.schedule()
    assert out.preempted_seq_ids == [lines[2].seq_id]
    assert chunks(out) == [(live.seq_id, 0, 12), (lines[0].seq_id, 8, 1),
                           (lines[1].seq_id, 8, 1)]
    assert live.status is SequenceStatus.RUNNING
    assert list(sched.waiting) == [lines[2], lines[3], lines[4]]


@pytest.mark.parametrize("policy", POLICIES)
def test_background_prompt_chunks_get_only_what_foreground_work_leaves(policy):
    """A line's long prompt is prefilling; a live request arrives: its whole prompt goes in
    the step, the line's chunk gets the rest of the budget (and nothing when none is left).
    The live tenant is the more served, so fair's hold-back (which would keep the line's
    chunk out of a less-served newcomer's first step entirely) does not apply."""
    sched = make_scheduler(policy, budget=16)
    line = batch_line(60)
    sched.add(line)
    assert chunks(sched.schedule()) == [(line.seq_id, 0, 16)]
    live = make_seq(10, tenant="live")
    sched.add(live)
    sched.share.counters["live"] = 1000.0
    out = sched.schedule()
    assert chunks(out) == [(live.seq_id, 0, 10), (line.seq_id, 16, 6)]
    decode(sched, out)
    big = make_seq(20, tenant="live")
    sched.add(big)
    out = sched.schedule()  # live decodes one, its second prompt takes the other 15
    assert chunks(out) == [(live.seq_id, 10, 1), (big.seq_id, 0, 15)]


@pytest.mark.parametrize("policy", POLICIES)
def test_waiting_lines_are_not_admitted_while_a_foreground_request_waits(policy):
    """Eight blocks of 4: a's request holds five. c's needs four and waits for them; a small
    line of the least-served tenant would fit in one but stays behind c, and once a is done
    both start, c first."""
    sched = make_scheduler(policy, num_blocks=8)
    a = make_seq(20, tenant="a")
    sched.add(a)
    decode(sched, sched.schedule())
    c, line = make_seq(16, tenant="c"), batch_line(4)
    sched.add(line)
    sched.add(c)
    sched.share.counters.update(a=100.0, c=100.0, batch=0.0)
    out = sched.schedule()
    assert chunks(out) == [(a.seq_id, 20, 1)]
    assert line.status is SequenceStatus.WAITING and c.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [c, line]
    sched.finish(a)
    out = sched.schedule()
    assert chunks(out) == [(c.seq_id, 0, 16), (line.seq_id, 0, 4)]


@pytest.mark.parametrize("policy", POLICIES)
def test_block_pressure_preempts_background_first_newest_first(policy):
    """Six blocks of 4, filled by a line (the oldest arrival) and two requests of a, the
    more-served tenant. Two steps later all three need a third block: the line goes, not a's
    newest, though a is served more. A live arrival under pressure takes the newest line's
    blocks too."""
    sched = make_scheduler(policy, num_blocks=6, budget=64)
    line = batch_line(7)
    a_old, a_new = make_seq(7, tenant="a"), make_seq(7, tenant="a")
    for seq in (line, a_old, a_new):
        sched.add(seq)
    sched.share.counters.update(a=500.0)
    out = sched.schedule()
    decode(sched, out)
    decode(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted_seq_ids == [line.seq_id]
    assert chunks(out) == [(a_old.seq_id, 8, 1), (a_new.seq_id, 8, 1)]
    assert line.status is SequenceStatus.WAITING and line.block_table == []

    sched = make_scheduler(policy, num_blocks=6, budget=64)
    older, newer = batch_line(8), batch_line(8)
    for seq in (older, newer):
        sched.add(seq)
    sched.schedule()  # two blocks each; two free
    live = make_seq(13, tenant="live")  # needs four
    sched.add(live)
    out = sched.schedule()
    assert out.preempted_seq_ids == [newer.seq_id]
    assert chunks(out)[0] == (live.seq_id, 0, 13)
    assert older.status is SequenceStatus.RUNNING and newer.status is SequenceStatus.WAITING


@pytest.mark.parametrize("policy", POLICIES)
def test_a_line_never_preempts_foreground_work(policy):
    """Every seat, then every block, held by live requests: a line waits, however much more
    the live tenant has been served."""
    for blocks, seats in ((64, 2), (4, 8)):
        sched = make_scheduler(policy, num_blocks=blocks, max_seqs=seats)
        a, b = make_seq(7, tenant="a"), make_seq(7, tenant="a")
        sched.add(a)
        sched.add(b)
        decode(sched, sched.schedule())
        line = batch_line(4)
        sched.add(line)
        sched.share.counters.update(a=1000.0, batch=0.0)
        out = sched.schedule()
        assert out.preempted_seq_ids == []
        assert [ch.seq_id for ch in out.chunks] == [a.seq_id, b.seq_id]
        assert line.status is SequenceStatus.WAITING


def run(sched: Scheduler, steps: int) -> list[int]:
    """Steps as the engine runs them: sampled tokens appended, sequences finished at their
    max_tokens. The ids in the order they finished."""
    done: list[int] = []
    for _ in range(steps):
        out = sched.schedule()
        decode(sched, out)
        for seq in list(sched.running):
            if seq.num_output_tokens >= (seq.sampling_params.max_tokens or 0):
                sched.finish(seq)
                done.append(seq.seq_id)
        if not sched.has_work:
            break
    return done


@pytest.mark.parametrize("policy", POLICIES)
def test_background_work_completes_once_foreground_is_idle(policy):
    """A batch bigger than the seats and the pool, beside live requests that preempt some of
    it: the live ones finish first, then every line finishes, preempted ones included."""
    sched = make_scheduler(policy, num_blocks=12, budget=16, max_seqs=4)
    lines = [batch_line(6, max_tokens=6) for _ in range(8)]
    for seq in lines:
        sched.add(seq)
    decode(sched, sched.schedule())
    live = [make_seq(10, tenant="live", max_tokens=4) for _ in range(3)]
    for seq in live:
        sched.add(seq)
    done = run(sched, 200)
    assert not sched.has_work
    assert sorted(done) == sorted(s.seq_id for s in lines + live)
    assert {done.index(s.seq_id) for s in live} == {0, 1, 2}
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 6 for s in lines)
    assert sched.block_manager.num_free_blocks == 12


@pytest.mark.parametrize("policy", POLICIES)
def test_background_decodes_are_limited_beside_foreground_work_only(policy):
    sched = make_scheduler(policy, background_decode_slots=2)
    lines = [batch_line(4) for _ in range(4)]
    live = make_seq(4, tenant="live")
    for seq in (*lines, live):
        sched.add(seq)
    decode(sched, sched.schedule())
    out = sched.schedule()  # the live request decodes, and the two oldest lines beside it
    assert [ch.seq_id for ch in out.chunks] == [live.seq_id, lines[0].seq_id, lines[1].seq_id]
    decode(sched, out)
    sched.finish(live)
    out = sched.schedule()  # alone, every line decodes (the two left behind catch up)
    assert [ch.seq_id for ch in out.chunks] == [s.seq_id for s in lines]


def test_nothing_is_held_back_for_a_waiting_line():
    """A more-served tenant's prefill yields to a less-served tenant's waiting request, but
    not to a waiting line."""
    sched = make_scheduler("fair", budget=16)
    a = make_seq(40, tenant="a")
    sched.add(a)
    sched.schedule()
    line = batch_line(4)
    sched.add(line)
    assert sched._tenants_to_hold_back() == set()
    out = sched.schedule()
    assert chunks(out) == [(a.seq_id, 16, 16)]


def test_interjections_serve_foreground_beside_background_and_never_lines():
    """The step in flight holds a line's prompt chunk only: a live request interjects however
    much more it has been served; a waiting line never does."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                                      interject_tokens=16), BlockManager(32, 4))
    line = batch_line(40)
    sched.add(line)
    step = sched.schedule()
    other_line = make_seq(4, priority=BACKGROUND_PRIORITY, tenant="batch2")
    sched.add(other_line)
    assert sched.schedule_interjection(step).chunks == []
    live = make_seq(6, tenant="live")
    sched.add(live)
    sched.share.counters["live"] = 1000.0
    out = sched.schedule_interjection(step)
    assert chunks(out) == [(live.seq_id, 0, 6)]
    assert other_line.status is SequenceStatus.WAITING
