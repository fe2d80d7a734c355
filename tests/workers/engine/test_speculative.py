"""Prompt lookup, the scheduler's proposals and their rollback: pure Python, exact asserts."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import make_seq
from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.speculative import (
    NgramIndex,
    SpecStats,
    SpeculativeConfig,
    back_off,
    check_request_tokens,
)


def test_ngram_index_proposes_what_followed_the_longest_earlier_match():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7]
    # "6 7" occurred at 1..2 and was followed by 8 9 1
    assert index.propose(tokens, 3) == [8, 9, 1]
    tokens += [8, 2, 7]
    # the last 3 ("8 2 7") never occurred before; "2 7" neither; "7" last ended at 7
    assert index.propose(tokens, 2) == [8, 2]
    assert index.propose([1, 2, 3], 4) == []  # a shorter, different sequence: re-indexed


def test_ngram_index_prefers_the_longer_match_and_the_latest_occurrence():
    index = NgramIndex(1, 2)
    tokens = [1, 2, 9, 3, 2, 8, 4, 1, 2]
    # "1 2" ends at 1 (followed by 9); "2" last ended at 4 (followed by 8): longer wins
    assert index.propose(tokens, 1) == [9]
    assert NgramIndex(1, 1).propose(tokens, 1) == [8]


def test_the_proposal_may_run_into_the_tail():
    assert NgramIndex(1, 2).propose([4, 4, 4], 5) == [4]


def test_a_repeating_run_proposes_from_its_first_occurrence():
    # the latest earlier "7 7" ends one token before the tail: too close to propose 3
    assert NgramIndex(2, 2).propose([1, 7, 7, 7, 7, 7], 3) == [7, 7, 7]
    assert NgramIndex(2, 2).propose([1, 7, 7, 2, 5, 7, 7], 2) == [2, 5]


def test_config_parses_and_checks():
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"num_tokens": 3}).num_tokens == 3
    with pytest.raises(ValueError, match="unknown"):
        SpeculativeConfig.parse({"tokens": 3})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(num_tokens=0)
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="ngram", draft_model="/m")
    assert SpeculativeConfig.parse({"method": "draft", "draft_model": "/m"}).draft_model == "/m"
    check_request_tokens(2, SpeculativeConfig(num_tokens=4))
    with pytest.raises(InvalidRequestError, match="exceeds"):
        check_request_tokens(5, SpeculativeConfig(num_tokens=4))
    with pytest.raises(InvalidRequestError):
        SamplingParams(speculative_tokens=-1)


def test_stats_count_by_position():
    stats = SpecStats()
    stats.record(3, 1)
    stats.record(2, 2)
    assert stats.figures() == {
        "spec_proposed_tokens": 5, "spec_accepted_tokens": 3, "spec_acceptance_rate": 0.6,
        "spec_position_1_proposed": 2, "spec_position_1_accepted": 2,
        "spec_position_2_proposed": 2, "spec_position_2_accepted": 1,
        "spec_position_3_proposed": 1, "spec_position_3_accepted": 0,
    }


def make_scheduler(num_blocks: int = 32, block_size: int = 4, budget: int = 32,
                   k: int = 3, max_batch: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                        speculative=SpeculativeConfig(num_tokens=k, max_batch=max_batch)),
        BlockManager(num_blocks, block_size),
    )


def decoding(sched: Scheduler, prompt: list[int], output: list[int], count: int = 1,
             **params):
    """`count` sequences whose prompt is computed and whose sampled tokens wait for their
    step (the last one is returned)."""
    seqs = []
    for _ in range(count):
        seq = make_seq(len(prompt))
        seq.token_ids = list(prompt)
        seq.sampling_params = SamplingParams(**({"max_tokens": 16} | params))
        sched.add(seq)
        seqs.append(seq)
    sched.schedule()
    for seq in seqs:
        seq.token_ids.extend(output)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        sched.block_manager.allocate_slots(seq, 0)
    return seqs[-1]


def test_a_decoding_row_carries_its_proposals_and_pays_for_them():
    sched = make_scheduler(budget=32)
    seq = decoding(sched, [1, 2, 3, 4, 5, 6], [2])
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.start_pos, chunk.token_ids, chunk.draft_token_ids) == (6, [2, 3, 4, 5], [3, 4, 5])
    assert chunk.num_samples == 1
    assert seq.num_computed_tokens == 10  # counted until the engine keeps or rolls back
    assert seq.block_table == [0, 1, 2]  # 10 slots of 4


def test_proposals_respect_budget_max_tokens_and_free_blocks():
    sched = make_scheduler(budget=3)
    decoding(sched, [1, 2, 3, 4, 5, 6], [2])
    assert sched.schedule().chunks[0].draft_token_ids == [3, 4]  # 1 + 2 fill the budget
    sched = make_scheduler()
    decoding(sched, [1, 2, 3, 4, 5, 6], [2], max_tokens=3)
    assert sched.schedule().chunks[0].draft_token_ids == [3]  # a 3rd output token is the last
    sched = make_scheduler(num_blocks=2)
    decoding(sched, [1, 2, 3, 4, 5, 6], [2])
    assert sched.schedule().chunks[0].draft_token_ids == [3]  # 8 slots: no third block


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"speculative_tokens": 0}])
def test_rows_whose_rule_depends_on_history_or_opted_out_do_not_propose(params):
    sched = make_scheduler()
    decoding(sched, [1, 2, 3, 4, 5, 6], [2], **params)
    assert sched.schedule().chunks[0].draft_token_ids == []


def test_no_proposals_when_more_rows_decode_than_max_batch():
    sched = make_scheduler(max_batch=1)
    decoding(sched, [1, 2, 3], [1], count=2)
    assert [c.draft_token_ids for c in sched.schedule().chunks] == [[], []]


def test_trim_gives_back_the_rejected_tail_and_names_only_kept_blocks():
    manager = BlockManager(8, 4, enable_caching=True)
    sched = Scheduler(SchedulerConfig(speculative=SpeculativeConfig(num_tokens=4)), manager)
    seq = decoding(sched, [1, 2, 3, 4, 5, 6], [2])
    sched.schedule()
    assert seq.block_table == [0, 1, 2] and seq.num_computed_tokens == 11
    # the engine kept one proposal (3) and added its own token (9): 9 tokens, 8 computed
    seq.token_ids.extend([3, 9])
    seq.num_computed_tokens = 8
    manager.trim(seq)
    assert seq.block_table == [0, 1, 2]  # 9 tokens need three blocks
    seq.token_ids.pop()
    seq.num_computed_tokens = 7
    manager.trim(seq)
    assert seq.block_table == [0, 1] and manager.num_free_blocks == 6
    manager.free(seq)
    assert len(manager.cached) == 1  # only [1, 2, 3, 4]: the second block was never full


def test_a_preempted_row_rolls_back_what_its_dropped_chunk_counted():
    sched = make_scheduler()
    seq = decoding(sched, [1, 2, 3, 4, 5, 6], [2])
    out = sched.schedule()
    sched.running.remove(seq)
    sched._preempt(seq, out)
    assert out.chunks == [] and seq.num_computed_tokens == 0 and seq.block_table == []


def test_a_draft_model_row_reserves_slots_for_the_runner_to_fill():
    sched = Scheduler(
        SchedulerConfig(speculative=SpeculativeConfig(method="draft", draft_model="/m",
                                                      num_tokens=3)),
        BlockManager(32, 4))
    seq = decoding(sched, [1, 2, 3, 4, 5, 6], [2])
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.token_ids, chunk.draft_token_ids, chunk.num_draft_slots) == ([2], [], 3)
    assert chunk.context_token_ids is seq.token_ids
    assert seq.num_computed_tokens == 10 and seq.block_table == [0, 1, 2]
    sched.running.remove(seq)
    sched._preempt(seq, out)
    assert seq.num_computed_tokens == 0 and seq.block_table == []


def test_a_sequence_whose_proposals_keep_missing_rests_longer_each_time():
    seq = make_seq(4)
    rests = []
    for _ in range(5):
        back_off(seq, 0)
        rests.append(seq.spec_rest)
    assert rests == [0, 1, 3, 7, 7]
    back_off(seq, 2)
    assert seq.spec_misses == 0


def test_a_resting_sequence_proposes_nothing_until_its_rest_is_over():
    sched = make_scheduler()
    seq = decoding(sched, [1, 2, 3, 4, 5, 6], [2])
    seq.spec_rest = 1
    out = sched.schedule()
    assert out.chunks[0].draft_token_ids == [] and seq.spec_rest == 0
    seq.token_ids.append(3)  # the engine's token for that step
    assert sched.schedule().chunks[0].draft_token_ids == [4, 5, 6]
