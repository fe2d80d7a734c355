"""The verification rule alone, on fixed logits: greedy prefixes, and sampled tokens whose
distribution is the target's whatever was proposed (chi-square against the exact p)."""

from __future__ import annotations

from collections import Counter

import torch

from workers.engine.sampling_params import SamplingParams
from workers.runner.rejection import SpecRow, verify
from workers.runner.sampler import SamplingRow

VOCAB = 6


def row(params: SamplingParams, drafts: list[int], seed: int | None = None,
        draft_probs: torch.Tensor | None = None, num_output_tokens: int = 1) -> SpecRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    sampling = SamplingRow(params=params, num_samples=1, generator=generator,
                           prompt_token_ids=[], output_token_ids=[],
                           num_output_tokens=num_output_tokens)
    return SpecRow(sampling, drafts, draft_probs)


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    logits = torch.full((len(tokens), VOCAB), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def test_greedy_keeps_the_agreeing_prefix_and_adds_the_models_token():
    rows = [row(GREEDY, [1, 2, 3]), row(GREEDY, [1, 2, 3]), row(GREEDY, [4])]
    logits = torch.cat([
        one_hot_logits([1, 2, 3, 5]),  # all kept, then the bonus 5
        one_hot_logits([1, 0, 3, 5]),  # the second differs: 1, then the model's 0
        one_hot_logits([2, 1]),  # the first differs
    ])
    results = verify(logits, rows, eos_token_ids=[])
    assert [r.token_ids for r in results] == [[1, 2, 3, 5], [1, 0], [2]]
    assert [r.num_drafts for r in results] == [3, 3, 1]


def test_min_tokens_bans_eos_at_each_positions_own_count():
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=3)
    # positions have 1, 2, 3 outputs before them: EOS (0) is banned at the first two only
    logits = one_hot_logits([0, 0, 0])
    logits[:, 4] = 4.0  # the runner-up
    result = verify(logits, [row(params, [4, 4], num_output_tokens=1)], eos_token_ids=[0])
    assert result[0].token_ids == [4, 4, 0]


def test_logprobs_are_those_of_the_raw_logits_at_each_kept_position():
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    logits = one_hot_logits([1, 2, 3])
    result = verify(logits.clone(), [row(params, [1, 4])], eos_token_ids=[])[0]
    raw = torch.log_softmax(logits, dim=-1)
    assert result.token_ids == [1, 2]
    assert [lp.token_id for lp in result.logprobs] == [1, 2]
    assert [lp.logprob for lp in result.logprobs] == [raw[0, 1].item(), raw[1, 2].item()]


# chi-square critical value at p = 0.001 for 5 degrees of freedom
CRITICAL_DOF5 = 20.52


def chi_square(counts: Counter, probs: list[float], total: int) -> float:
    return sum((counts[t] - total * p) ** 2 / (total * p) for t, p in enumerate(probs) if p > 0)


def draws(logits: torch.Tensor, drafts: list[int], trials: int,
          draft_probs: torch.Tensor | None = None) -> tuple[Counter, Counter]:
    """Histograms of the first emitted token, and of the second when the first was kept.
    With `draft_probs` the one proposal is drawn from them each trial, as a draft model's."""
    params = SamplingParams(temperature=1.0, max_tokens=16)
    first, second = Counter(), Counter()
    proposer = torch.Generator().manual_seed(12345)
    for seed in range(trials):
        if draft_probs is not None:
            drafts = [int(torch.multinomial(draft_probs[0], 1, generator=proposer))]
        tokens = verify(logits.clone(), [row(params, drafts, seed, draft_probs)], [])[0].token_ids
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
    return first, second


def test_prompt_lookup_proposals_leave_the_target_distribution_unchanged():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    p = torch.softmax(logits, dim=-1)
    first, second = draws(logits, [2, 4], trials=4000)
    assert 0 < first[2] < 4000  # the proposal was kept sometimes, rejected sometimes
    assert chi_square(first, p[0].tolist(), 4000) < CRITICAL_DOF5
    kept = sum(second.values())
    assert kept > 500 and chi_square(second, p[1].tolist(), kept) < CRITICAL_DOF5


def test_draft_model_proposals_leave_the_target_distribution_unchanged():
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    q = torch.softmax(torch.randn(1, VOCAB) * 2, dim=-1)  # a draft model that disagrees
    p = torch.softmax(logits, dim=-1)
    assert (p - q).abs().sum() > 0.5  # far enough apart that many proposals are rejected
    first, _ = draws(logits, [0], trials=4000, draft_probs=q)
    assert chi_square(first, p[0].tolist(), 4000) < CRITICAL_DOF5
