"""The sampler's arithmetic on hand-made logits."""

from __future__ import annotations

import math

import torch

from workers.engine.sampling_params import SamplingParams
from workers.runner.sampler import SamplingRow, row_argmax, sample


def row(params: SamplingParams, *, prompt=(), output=(), n=1, seed=None) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, n, generator, list(prompt), list(output), len(output))


def test_frequency_and_presence_penalties_subtract_per_count():
    logits = torch.tensor([[5.0, 4.9, 1.0, 0.0]])
    params = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    # token 0 was generated twice: 5.0 - 2*0.5 - 0.25 = 3.75 < 4.9 -> token 1 wins
    result = sample(logits.clone(), [row(params, output=[0, 0, 2])], eos_token_ids=[])
    assert result[0].token_ids == [1]
    alone = sample(logits.clone(), [row(SamplingParams(temperature=0))], eos_token_ids=[])
    assert alone[0].token_ids == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[3.0, 2.0, -1.0, -1.5]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 0 seen in the prompt: 3.0 / 2 = 1.5 < 2.0 -> token 1
    assert sample(logits.clone(), [row(params, prompt=[0])], [])[0].token_ids == [1]
    # negative seen logits get worse: -1 * 2 = -2 < -1.5
    only_neg = torch.tensor([[-1.0, -1.5, -9.0, -9.0]])
    assert sample(only_neg, [row(params, prompt=[0])], [])[0].token_ids == [1]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 8.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    early = sample(logits.clone(), [row(params, output=[2])], eos_token_ids=[0])
    assert early[0].token_ids == [2]
    late = sample(logits.clone(), [row(params, output=[2, 2])], eos_token_ids=[0])
    assert late[0].token_ids == [0]


def test_seeded_rows_do_not_depend_on_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 1000)
    params = SamplingParams(temperature=1.0, seed=42)
    solo = sample(logits[1:2].clone(), [row(params, seed=42)], [])[0].token_ids
    other = SamplingParams(temperature=1.0)
    batch = sample(logits.clone(), [row(other), row(params, seed=42), row(other)], [])
    assert batch[1].token_ids == solo


def test_n_samples_from_one_row_and_logprobs_of_each():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, n=64, logprobs=2, seed=1)
    result = sample(logits.clone(), [row(params, n=64, seed=1)], [])[0]
    assert len(result.token_ids) == 64
    assert set(result.token_ids) <= {0, 1, 2, 3} and len(set(result.token_ids)) > 1
    expected = torch.log_softmax(logits[0], dim=0)
    for token, lp in zip(result.token_ids, result.logprobs, strict=True):
        assert lp.token_id == token
        assert math.isclose(lp.logprob, expected[token].item(), rel_tol=1e-6)
        assert [t for t, _ in lp.top] == [0, 1]


def test_top_k_and_top_p_keep_only_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2)
    k2 = SamplingParams(temperature=5.0, top_k=2)
    p = SamplingParams(temperature=1.0, top_p=0.7)  # probs .64 .24 ...: nucleus = {0, 1}
    seen: set[int] = set()
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    for g in gens:
        rows = [SamplingRow(k2, 1, g, [], [], 0), SamplingRow(p, 1, g, [], [], 0)]
        for result in sample(logits.clone(), rows, []):
            seen.update(result.token_ids)
    assert seen == {0, 1}


def test_windowed_top_k_top_p_equals_the_full_sort():
    from workers.runner.sampler import _masked_window, _top_k_top_p

    torch.manual_seed(0)
    peaked = torch.randn(4, 5000) * 4  # nucleus inside the top-1024 window
    flat = torch.randn(3, 5000) * 0.01  # nucleus far wider than the window: full sort
    logits = torch.cat([peaked, flat])
    params = [
        SamplingParams(top_p=0.9), SamplingParams(top_k=40), SamplingParams(top_k=2000, top_p=0.5),
        SamplingParams(top_p=1.0, temperature=0.7), SamplingParams(top_p=0.95),
        SamplingParams(top_k=10, top_p=0.3), SamplingParams(top_p=0.99),
    ]
    expected, _ = _masked_window(logits, params, width=5000)  # a sort of the whole vocabulary
    expected[3] = logits[3]  # top_p=1 keeps all (a full cumsum would round the tail away)
    got = _top_k_top_p(logits, params)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], expected[~torch.isinf(expected)])
    kept = (~torch.isinf(got)).sum(dim=-1).tolist()
    assert kept[1] == 40 and kept[3] == 5000 and kept[5] <= 10
    assert kept[4] > 1024  # the flat row really took the full-sort path


def test_row_argmax_is_argmax_with_ties_nan_and_all_masked_rows():
    gen = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 4, (16, 5000), generator=gen).float()  # many equal maxima
    assert torch.equal(row_argmax(ties), ties.argmax(dim=-1))
    odd = torch.full((3, 300), float("-inf"))
    odd[1, 40] = odd[1, 41] = 2.0
    odd[2, 7] = float("nan")
    assert row_argmax(odd).tolist() == odd.argmax(dim=-1).tolist() == [0, 40, 7]


def _mixed_rows(count: int) -> list[SamplingRow]:
    """Rows with every per-row setting the sampler batches, in turn."""
    kinds = [
        SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(temperature=0, repetition_penalty=1.7, logit_bias={3: 5.0, 9: -2.5}),
        SamplingParams(temperature=0.8, min_tokens=4, stop_token_ids=[5], top_p=0.9),
        SamplingParams(temperature=1.2, frequency_penalty=-0.4, repetition_penalty=0.6,
                       min_p=0.05, seed=3),
        SamplingParams(temperature=0),
    ]
    rows = []
    for i in range(count):
        params = kinds[i % len(kinds)]
        generator = torch.Generator().manual_seed(i) if params.seed is not None else None
        output = [(7 * i + 3 * k) % 40 for k in range(i % 4)]
        rows.append(SamplingRow(params, 1, generator, [(5 * i) % 40, 11, 11], output,
                                len(output)))
    return rows


def test_penalties_bias_and_bans_of_many_rows_equal_the_per_row_formulas():
    """Batched over the rows that have them, with each row's own settings: the same values,
    bit for bit, as applying each row's formulas alone."""
    from workers.runner.sampler import apply_logit_bias, apply_penalties

    torch.manual_seed(0)
    logits = torch.randn(10, 40) * 3
    rows = _mixed_rows(10)
    expected = logits.clone()
    for i, r in enumerate(rows):
        p, row_logits = r.params, expected[i]
        for token, value in (p.logit_bias or {}).items():
            row_logits[token] += value
        if r.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=40).float()
            row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)))
            values = row_logits[seen]
            row_logits[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                           values * p.repetition_penalty)
        if r.num_output_tokens < p.min_tokens:
            row_logits[[0, *p.stop_token_ids]] = float("-inf")
    got = logits.clone()
    apply_logit_bias(got, rows)
    apply_penalties(got, rows, [0])
    assert torch.equal(got, expected)


def test_sampling_makes_no_host_tensor_per_row(monkeypatch):
    """Per-row settings reach the device as one tensor per step each: sampling 12 rows makes
    as many tensors from Python values as sampling 6 (on CUDA each is a copy), and none with
    `torch.tensor(..., device=...)`, which copies synchronously."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made = torch.tensor

    def tensor(*args, **kwargs):
        assert "device" not in kwargs, "torch.tensor(..., device=...) waits for the device"
        return made(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.made += func.overloadpacket.__name__ == "lift_fresh"
            return func(*args, **(kwargs or {}))

    counts = []
    for rows in (6, 12):
        torch.manual_seed(0)
        logits = torch.randn(rows, 40) * 3
        with Count() as count:
            results = sample(logits, _mixed_rows(rows), [0])
        assert all(len(r.token_ids) == 1 for r in results)
        counts.append(count.made)
    assert counts[0] == counts[1]
