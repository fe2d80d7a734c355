"""Step costs in token-equivalents, the measured speed, and the step limit while tenants share
the engine (exact asserts on chunk sizes)."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import make_seq
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.step_cost import StepCost, StepRoom, attention_tokens


def test_chunk_costs_grow_with_their_context():
    flat, weighted = StepCost(), StepCost(attention_tokens=1000)
    assert flat.of_chunk(100, 5000) == 100.0
    assert weighted.of_chunk(100, 0) == 100 * (1 + 50 / 1000)
    assert weighted.of_chunk(100, 1950) == 100 * 3.0
    assert flat.tokens_within(99.5, 0, 500) == 99
    for units, start in ((300.0, 0), (300.0, 1950), (50.0, 7000)):
        n = weighted.tokens_within(units, start, 10_000)
        assert weighted.of_chunk(n, start) <= units < weighted.of_chunk(n + 1, start)
    assert weighted.tokens_within(1e9, 0, 64) == 64
    assert weighted.tokens_within(0, 0, 64) == 0


def test_the_speed_is_a_moving_average_of_timed_steps():
    cost = StepCost()
    assert cost.units_in(1.0) == 1000.0  # nothing timed yet: a slow machine is assumed
    cost.observe(10, 5.0)  # under min_units: mostly fixed overhead, not counted
    assert cost.seconds_per_unit is None
    cost.observe(100, 1.0)
    cost.observe(100, 2.0)
    assert cost.seconds_per_unit == pytest.approx(0.01 + 0.3 * 0.01)
    assert cost.units_in(0.013) == pytest.approx(1.0)


def test_the_first_prompt_chunk_always_advances():
    room = StepRoom(StepCost(), units=4.0, min_chunk=16)
    assert room.take(100, 0) == 16  # the floor, though it costs more than the room
    assert room.take(100, 0) == 0  # nothing left for a second chunk
    assert StepRoom(StepCost(), units=None, min_chunk=16).take(700, 0) == 700


def test_smollm2s_attention_break_even_context():
    class Config:
        hidden_size, num_attention_heads, num_key_value_heads = 576, 9, 3
        intermediate_size = 1536

    assert attention_tokens(Config()) == 3072.0


def make_scheduler(shared_step_s: float, policy: str = "fair") -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                      shared_step_s=shared_step_s, sharing_window_s=10.0,
                                      policy=policy),
                      BlockManager(512, 4))
    sched.cost.seconds_per_unit = 0.001  # as if measured: 1 ms per token
    sched.clock = lambda: 100.0
    return sched


def chunks(out) -> list[tuple[int, int, int]]:
    return [(c.seq_id, c.start_pos, c.num_tokens) for c in out.chunks]


def test_one_tenant_alone_is_never_limited():
    sched = make_scheduler(shared_step_s=0.1)
    a = make_seq(400, tenant="a")
    sched.add(a)
    assert chunks(sched.schedule()) == [(a.seq_id, 0, 400)]


def test_while_two_tenants_share_a_long_prompt_advances_by_the_step_limit():
    """B's chat finished a moment ago (its user is typing): A's 400-token prompt runs in
    100-token steps (0.1 s at 1 ms a token), so B's next message never waits behind a 0.4 s
    step. Once B has been gone longer than the window, A's prompt is not limited."""
    sched = make_scheduler(shared_step_s=0.1)
    b = make_seq(4, tenant="b")
    sched.add(b)
    sched.schedule()
    sched.finish(b)
    a = make_seq(400, tenant="a")
    sched.add(a)
    assert chunks(sched.schedule()) == [(a.seq_id, 0, 100)]
    assert chunks(sched.schedule()) == [(a.seq_id, 100, 100)]
    sched.clock = lambda: 111.0  # B left at 100.0; the window is 10 s
    assert chunks(sched.schedule()) == [(a.seq_id, 200, 200)]


def test_the_limit_is_off_by_default_and_guessed_before_any_step_was_timed():
    sched = make_scheduler(shared_step_s=0.0)
    a, b = make_seq(400, tenant="a"), make_seq(300, tenant="b")
    sched.add(a)
    sched.add(b)
    assert chunks(sched.schedule()) == [(a.seq_id, 0, 400), (b.seq_id, 0, 112)]
    untimed = make_scheduler(shared_step_s=0.2)
    untimed.cost.seconds_per_unit = None  # the 1 ms guess: 200 units
    a = make_seq(400, tenant="a")
    untimed.add(a)
    untimed.add(make_seq(4, tenant="b"))
    assert chunks(untimed.schedule())[0] == (a.seq_id, 0, 200)


def test_a_newcomer_is_admitted_within_what_is_left_or_waits_a_step():
    """Fair: B's 50-token prompt arrives while A's 300-token prompt advances 100 tokens a
    step; A's chunk sits that step out (B is less served) and B's prompt runs in it. FCFS: A's
    chunk takes the whole 100 units, so B, not the step's first chunk, waits, its blocks
    handed back."""
    for policy in ("fair", "fcfs"):
        sched = make_scheduler(shared_step_s=0.1, policy=policy)
        a, b = make_seq(300, tenant="a"), make_seq(50, tenant="b")
        sched.add(a)
        sched.add(make_seq(2, tenant="c", max_tokens=1))  # a third tenant: the engine is shared
        first = chunks(sched.schedule())
        assert first[0] == (a.seq_id, 0, 100)
        sched.add(b)
        out = chunks(sched.schedule())
        if policy == "fair":
            assert (b.seq_id, 0, 50) in out and all(c[0] != a.seq_id for c in out)
        else:
            assert out[0] == (a.seq_id, 100, 100) and all(c[0] != b.seq_id for c in out)
            assert b.block_table == [] and b in list(sched.waiting)


def test_a_newcomer_does_not_start_with_a_sliver_of_the_room():
    """A's last 95 prompt tokens and C's 2 leave 3 units of the 100: B's 50-token prompt
    would start with 3 tokens and then run behind A's prefills step after step. It waits a
    step instead, its blocks handed back."""
    sched = make_scheduler(shared_step_s=0.1, policy="fcfs")
    a, c = make_seq(195, tenant="a"), make_seq(2, tenant="c", max_tokens=1)
    sched.add(a)
    sched.add(c)
    assert chunks(sched.schedule()) == [(a.seq_id, 0, 100)]
    b = make_seq(50, tenant="b")
    sched.add(b)
    assert chunks(sched.schedule()) == [(a.seq_id, 100, 95), (c.seq_id, 0, 2)]
    assert b.block_table == [] and list(sched.waiting) == [b]
