"""Verify a speculating row's proposed tokens against the target model's logits.

A row proposed `k` tokens `d_1..d_k` after its last token, and the step computed logits at all
`k + 1` positions. Greedy rows keep proposals while they equal the argmax and then add the
argmax where they first differ (or after the last). Sampling rows use the standard rejection
rule, so every emitted token is distributed exactly as without speculation: `d_i` is kept with
probability `min(1, p_i(d_i) / q_i(d_i))`; the first rejected position instead draws from the
residual `max(0, p_i - q_i)` renormalised, and when every proposal is kept one more token is
drawn from `p_{k+1}`. Prompt lookup proposes deterministically (`q_i` is one-hot at `d_i`):
`d_i` is kept with probability `p_i(d_i)`, and the residual is `p_i` without `d_i`.

`p_i` is the row's own sampling distribution (grammar mask, logit bias, the `min_tokens` ban
at the position's own output count, temperature, top-k/top-p, min-p), as `sampler.sample`
draws from. A grammar's mask at position i assumes the proposals before it were kept, which
is the only case where position i is sampled from (`token_mask.fill_ahead`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from workers.runner import token_mask
from workers.runner.sampler import (
    SampleResult,
    SamplingRow,
    apply_logit_bias,
    apply_penalties,
    gather_logprobs,
    row_argmax,
    select_rows,
    target_probs,
)
from workers.runner.token_mask import TokenMask


@dataclass
class SpecRow:
    row: SamplingRow
    drafts: list[int]
    draft_probs: torch.Tensor | None = None  # [k, vocab] from a draft model; None: one-hot


def verify(logits: torch.Tensor, rows: list[SpecRow], eos_token_ids: list[int],
           mask: TokenMask | None = None) -> list[SampleResult]:
    """logits: `[sum(k + 1), vocab]` float32, each row's positions in order. Returns per row
    the kept proposals plus one token of the model's own (1 to k + 1 tokens). `mask` holds
    the grammar's allowed tokens of constrained positions (indices into those rows)."""
    flat = [dataclasses.replace(r.row, num_samples=1,
                                num_output_tokens=r.row.num_output_tokens + i)
            for r in rows for i in range(len(r.drafts) + 1)]
    want = [i for i, f in enumerate(flat) if f.params.logprobs is not None]
    raw = torch.log_softmax(select_rows(logits, want), dim=-1) if want else None
    if mask is not None:
        token_mask.apply(logits, mask.rows, mask.bitmask)
    apply_logit_bias(logits, flat)
    apply_penalties(logits, flat, eos_token_ids)  # the min_tokens ban, per position
    argmax = row_argmax(logits).tolist()
    random = [i for i, f in enumerate(flat) if not f.params.greedy]
    probs = None
    if random:
        probs = target_probs(select_rows(logits, random), [flat[i].params for i in random],
                             normalize=True)
    prob_row = {flat_index: j for j, flat_index in enumerate(random)}
    chosen = list(argmax)
    emitted: list[list[int]] = []
    start = 0
    for spec in rows:
        k = len(spec.drafts)
        if spec.row.params.greedy:
            tokens = _accept_greedy(argmax[start : start + k + 1], spec.drafts)
        else:
            assert probs is not None
            first = prob_row[start]
            tokens = _accept_sampled(probs[first : first + k + 1], spec)
        chosen[start : start + len(tokens)] = tokens
        emitted.append(list(range(start, start + len(tokens))))
        start += k + 1
    logprobs = gather_logprobs(raw, want, flat, chosen) if raw is not None else {}
    return [
        SampleResult(
            token_ids=[chosen[i] for i in positions],
            logprobs=[logprobs[i] for i in positions]
            if spec.row.params.logprobs is not None else None,
            num_drafts=len(spec.drafts),
        )
        for spec, positions in zip(rows, emitted, strict=True)
    ]


def _accept_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    tokens = []
    for draft, best in zip(drafts, argmax, strict=False):
        tokens.append(best)
        if best != draft:
            return tokens
    tokens.append(argmax[len(drafts)])
    return tokens


def _accept_sampled(probs: torch.Tensor, spec: SpecRow) -> list[int]:
    """probs: `[k + 1, vocab]` the target's distributions at the row's positions."""
    k, generator = len(spec.drafts), spec.row.generator
    drafts = torch.tensor(spec.drafts, device=probs.device)
    p = probs[:k].gather(1, drafts.unsqueeze(1)).squeeze(1)
    q = (torch.ones_like(p) if spec.draft_probs is None
         else spec.draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1))
    u = torch.rand(k, generator=generator, device=probs.device, dtype=p.dtype)
    kept = (u * q < p).tolist()
    num_kept = kept.index(False) if False in kept else k
    if num_kept == k:
        return [*spec.drafts, draw(probs[k], generator)]
    target = probs[num_kept]
    if spec.draft_probs is None:
        residual = target.clone()
        residual[spec.drafts[num_kept]] = 0.0
    else:
        residual = (target - spec.draft_probs[num_kept]).clamp_min(0.0)
    if not bool(residual.sum() > 0):  # p == q to the last bit: any draw from p is right
        residual = target
    return [*spec.drafts[:num_kept], draw(residual, generator)]


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability proportional to `weights` (the exponential race)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
