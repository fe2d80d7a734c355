"""Tenant-fair scheduling (VTC): admission order, weights, idle lift, fair preemption."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import make_seq
from tests.workers.engine.test_scheduler import decode
from workers.engine.block_manager import BlockManager
from workers.engine.fair_share import FairQueue, FairShare
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import SequenceStatus


def make_scheduler(policy: str, num_blocks: int = 64, budget: int = 16,
                   max_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     policy=policy),
                     BlockManager(num_blocks, 4))


def test_a_heavy_backlog_does_not_hold_back_a_light_tenant():
    """A queues four prompts before B's one: fair admits B second, FCFS fourth."""
    admitted = {}
    for policy in ("fair", "fcfs"):
        sched = make_scheduler(policy, budget=16)
        heavy = [make_seq(8, tenant="a") for _ in range(4)]
        light = make_seq(8, tenant="b")
        for seq in [*heavy, light]:
            sched.add(seq)
        out = sched.schedule()
        admitted[policy] = [(ch.seq_id, ch.num_tokens) for ch in out.chunks]
        if policy == "fair":
            assert (heavy[0].block_table, light.block_table) == ([0, 1], [2, 3])
        expected_second = light if policy == "fair" else heavy[1]
        assert admitted[policy] == [(heavy[0].seq_id, 8), (expected_second.seq_id, 8)]
    assert make_scheduler("fair").share.counters == {}


def test_tokens_split_by_weight_while_both_tenants_are_backlogged():
    """Weight 2 against 1, one 4-token prompt admitted per step: A gets two of every three."""
    share = FairShare()
    queue = FairQueue(share)
    for i in range(12):
        for tenant, weight in (("a", 2.0), ("b", 1.0)):
            seq = make_seq(4, tenant=tenant, weight=weight, seq_id=1000 + 2 * i + (tenant == "b"))
            share.arrive(seq)
            queue.push(seq)
    served = []
    for _ in range(9):
        seq = queue.pop()
        share.charge(seq, num_prompt=4, num_output=0)
        served.append(seq.tenant)
    assert served.count("a") == 6 and served.count("b") == 3
    assert share.counters == {"a": 12.0, "b": 12.0}


def test_output_tokens_cost_more_than_prompt_tokens():
    share = FairShare(prompt_weight=1.0, output_weight=2.0)
    seq = make_seq(4, tenant="a", weight=4.0)
    share.charge(seq, num_prompt=8, num_output=2)
    assert share.counters["a"] == pytest.approx((8 + 2 * 2) / 4.0)


def test_an_idle_tenant_does_not_bank_service():
    """B idles while A is served 100 tokens; on arrival B starts level with A (just under:
    first among equals), not 100 behind."""
    share = FairShare()
    a1, a2 = make_seq(4, tenant="a"), make_seq(4, tenant="a")
    share.arrive(a1)
    share.charge(a1, num_prompt=100, num_output=0)
    b = make_seq(4, tenant="b")
    share.arrive(b)
    assert share.counters["b"] == pytest.approx(100.0) and share.counters["b"] < 100.0
    share.arrive(a2)  # A is already active: no lift for its second request
    assert share.counters["a"] == 100.0
    share.leave(a1)
    share.leave(a2)
    share.leave(a2)  # a second leave of the same sequence is ignored
    assert dict(share.active) == {"b": 1}
    assert share.shares() == {"b": 0.0}


def test_fair_preemption_takes_the_most_served_tenants_newest_sequence():
    """Pool of 6 blocks of 4: A's two prompts of 7 and B's of 3 fill five. Two steps later
    A's both need a third block: under FCFS the victim is the tail (B), under fair A's newest
    (A has been served 20 token units to B's 5), and B goes on decoding."""
    tables = {"fair": [[0, 1], [3, 4], [2]],  # B is admitted second, ahead of A's second
              "fcfs": [[0, 1], [2, 3], [4]]}
    for policy, victim in (("fair", "a_new"), ("fcfs", "b")):
        sched = make_scheduler(policy, num_blocks=6, budget=64)
        seqs = {"a_old": make_seq(7, tenant="a"), "a_new": make_seq(7, tenant="a"),
                "b": make_seq(3, tenant="b")}
        for seq in seqs.values():
            sched.add(seq)
        out = sched.schedule()
        assert [s.block_table for s in seqs.values()] == tables[policy]
        decode(sched, out)
        out = sched.schedule()
        assert out.preempted_seq_ids == []
        decode(sched, out)
        out = sched.schedule()
        assert out.preempted_seq_ids == [seqs[victim].seq_id]
        survivors = [name for name in seqs if name != victim]
        assert [ch.seq_id for ch in out.chunks] == [seqs[n].seq_id for n in survivors]
        assert seqs[victim].status is SequenceStatus.WAITING
        # prompts at 1 per token, outputs at 2; a preempted sequence is not charged its step
        counters = {"fair": {"a": 20.0, "b": 7.0}, "fcfs": {"a": 22.0, "b": 5.0}}[policy]
        assert sched.share.counters == counters


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fair, fcfs"):
        make_scheduler("lottery")


def test_a_less_served_tenants_prompt_runs_in_a_short_step():
    """A's 40-token prompt prefills 16 tokens a step. B's 4-token prompt arrives: under fair
    the next step is B's prompt alone (A's chunk sits it out, so B's first token comes after
    a 4-token step, not a 16-token one); under FCFS A's chunk fills the step and B waits."""
    for policy, second in (("fair", [("b", 0, 4)]), ("fcfs", [("a", 16, 16)])):
        sched = make_scheduler(policy, budget=16)
        a, b = make_seq(40, tenant="a"), make_seq(4, tenant="b")
        sched.add(a)
        first = sched.schedule()
        assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in first.chunks] == [
            (a.seq_id, 0, 16)]
        sched.add(b)
        out = sched.schedule()
        ids = {"a": a.seq_id, "b": b.seq_id}
        assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
            (ids[t], start, n) for t, start, n in second]
        if policy == "fair":  # then A goes on, beside B (whose token is not sampled yet)
            out = sched.schedule()
            assert [(ch.seq_id, ch.start_pos, ch.num_tokens) for ch in out.chunks] == [
                (a.seq_id, 16, 16)]


def test_prefills_do_not_yield_to_a_request_that_cannot_start():
    """B's first chunk needs 4 free blocks: with 5 free A's prefill is held back for it; with
    2 free (enough for A's last 4 tokens only) A goes on rather than stall behind B."""
    for free, held, chunks in ((5, {"a"}, "b"), (2, set(), "a")):
        sched = make_scheduler("fair", num_blocks=12, budget=16)
        a, b = make_seq(20, tenant="a"), make_seq(40, tenant="b")
        sched.add(a)
        sched.schedule()  # A: 16 tokens in 4 blocks; its last 4 tokens need one more
        pool = sched.block_manager.free_block_ids
        sched.block_manager.free_block_ids = type(pool)(list(pool.items())[:free])
        sched.add(b)
        assert sched._tenants_to_hold_back() == held
        out = sched.schedule()
        expected = {"b": [(b.seq_id, 16)], "a": [(a.seq_id, 4)]}[chunks]
        assert [(ch.seq_id, ch.num_tokens) for ch in out.chunks] == expected


def test_a_tenant_shut_out_of_every_seat_gets_one():
    """max_num_seqs 2, both seats A's: under fair B's request takes the seat of A's newest
    (preempted, recomputed later) and runs at once; under FCFS B waits for a seat. A tenant
    that already has a seat never preempts for a second."""
    for policy in ("fair", "fcfs"):
        sched = make_scheduler(policy, budget=64, max_seqs=2)
        a1, a2, b1, b2 = (make_seq(6, tenant="a"), make_seq(6, tenant="a"),
                          make_seq(5, tenant="b"), make_seq(5, tenant="b"))
        sched.add(a1)
        sched.add(a2)
        decode(sched, sched.schedule())
        sched.add(b1)
        sched.add(b2)
        out = sched.schedule()
        if policy == "fair":
            assert out.preempted_seq_ids == [a2.seq_id]
            assert [(ch.seq_id, ch.num_tokens) for ch in out.chunks] == [
                (a1.seq_id, 1), (b1.seq_id, 5)]
            assert a2.status is SequenceStatus.WAITING and b2.status is SequenceStatus.WAITING
        else:
            assert out.preempted_seq_ids == []
            assert [(ch.seq_id, ch.num_tokens) for ch in out.chunks] == [
                (a1.seq_id, 1), (a2.seq_id, 1)]


def test_interjection_candidates_are_the_first_few_of_tenants_under_their_ceiling():
    share = FairShare()
    queue = FairQueue(share)
    seqs = {t: [make_seq(4, tenant=t) for _ in range(3)] for t in ("a", "b", "c", "d")}
    for group in seqs.values():
        for seq in group:
            queue.push(seq)
    share.counters.update(a=0.0, b=5.0, c=1.0, d=9.0)
    ceilings = {"a": -1.0, "b": 5.0, "c": 5.0, "d": 5.0}  # a's ceiling rules it out
    picked = queue.candidates(ceilings.__getitem__, per_tenant=2)
    assert picked == [*seqs["c"][:2], *seqs["b"][:2]]  # c is less served; d is too far ahead
    assert len(queue) == 12  # nothing taken
