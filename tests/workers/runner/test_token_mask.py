"""Token masks in the sampler: packed bits -> -inf, before bias, penalties and temperature."""

from __future__ import annotations

import pytest
import torch

from tests.devices import DEVICES
from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import StructuredOutputs
from workers.runner import token_mask
from workers.runner.sampler import SamplingRow, sample
from workers.runner.token_mask import TokenMask

VOCAB = 70  # not a multiple of 32: the last word is partly used


def bits(allowed: list[set[int]]) -> torch.Tensor:
    mask = torch.zeros(len(allowed), token_mask.bitmask_words(VOCAB), dtype=torch.int32)
    for r, ids in enumerate(allowed):
        for t in ids:
            word = int(mask[r, t // 32]) | (1 << (t % 32))
            mask[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return mask


def row(params: SamplingParams, n: int = 1, seed: int | None = None,
        device: str = "cpu") -> SamplingRow:
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return SamplingRow(params, n, generator, [], [], 0)


@pytest.mark.parametrize("device", DEVICES)
def test_unpack_reads_bit_i_of_word_j_as_token_32j_plus_i(device):
    allowed = [{0, 31, 32, 63, 69}, set(range(VOCAB))]
    unpacked = token_mask.unpack(bits(allowed).to(device), VOCAB).cpu()
    assert unpacked.shape == (2, VOCAB)
    assert set(torch.nonzero(unpacked[0]).flatten().tolist()) == allowed[0]
    assert bool(unpacked[1].all())


class _Matcher:
    def __init__(self, ids: set[int]) -> None:
        self.ids = ids

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = bits([self.ids])[0]


def test_fill_asks_each_matcher_for_its_row():
    mask = token_mask.fill([_Matcher({3}), _Matcher({4, 5})], [2, 0], VOCAB, torch.device("cpu"))
    assert mask.rows == [2, 0]
    assert torch.equal(mask.bitmask, bits([{3}, {4, 5}]))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_sampled_rows_only_pick_allowed_tokens(device):
    """On CUDA the mask is applied to the device's logits, sampled with its generator."""
    structured = StructuredOutputs(regex="x")
    greedy = SamplingParams(temperature=0, structured=structured)
    hot = SamplingParams(temperature=5.0, structured=structured)
    free = SamplingParams(temperature=0)
    logits = torch.randn(3, VOCAB, device=device)
    logits[:, 10] = 50.0  # the best token everywhere, disallowed in the constrained rows
    mask = TokenMask([0, 2], bits([{40, 41}, {3, 60, 65}]).to(device))
    for seed in range(20):
        rows = [row(greedy), row(free), row(hot, seed=seed, device=device)]
        out = sample(logits.clone(), rows, [], mask)
        assert out[0].token_ids[0] in {40, 41}
        assert out[1].token_ids == [10]  # the unconstrained row is untouched
        assert out[2].token_ids[0] in {3, 60, 65}


def test_samples_of_one_row_share_its_mask():
    params = SamplingParams(temperature=3.0, n=4, structured=StructuredOutputs(regex="x"))
    logits = torch.zeros(2, VOCAB)
    mask = TokenMask([1], bits([{7, 8}]))
    out = sample(logits, [row(SamplingParams(temperature=0)), row(params, n=4, seed=1)], [], mask)
    assert set(out[1].token_ids) <= {7, 8} and len(out[1].token_ids) == 4


def test_mask_comes_before_logit_bias_and_min_tokens_defers_to_the_grammar():
    # +100 on a disallowed token cannot revive it; EOS (0) is the only allowed token, and
    # min_tokens does not ban it under a grammar (the grammar decides where output ends)
    params = SamplingParams(temperature=0, min_tokens=5, logit_bias={9: 100},
                            structured=StructuredOutputs(regex="x"))
    out = sample(torch.zeros(1, VOCAB), [row(params)], [0], TokenMask([0], bits([{0}])))
    assert out[0].token_ids == [0]


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.tensor([[5.0, 1.0, 0.0, -2.0]])
    force = SamplingParams(temperature=0, logit_bias={3: 100})
    ban = SamplingParams(temperature=0, logit_bias={0: -100})
    out = sample(logits.repeat(2, 1), [row(force), row(ban)], [])
    assert [o.token_ids for o in out] == [[3], [1]]


@pytest.mark.parametrize("device", DEVICES)
def test_ids_past_the_mask_width_are_disallowed(device):
    logits = torch.zeros(1, 100, device=device)
    logits[0, 90] = 10.0  # a padded vocabulary id the tokenizer (and the grammar) never made
    # all 64 ids the grammar knows allowed
    mask = torch.full((1, 2), -1, dtype=torch.int32, device=device)
    token_mask.apply(logits, [0], mask)
    logits = logits.cpu()
    assert bool(torch.isinf(logits[0, 64:]).all()) and not bool(torch.isinf(logits[0, :64]).any())
