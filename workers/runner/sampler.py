"""Turn the logits of each sampling row into tokens, per the row's own SamplingParams.

Sampling uses the exponential-race trick (argmax of p / Exp(1) noise) so each seeded row
draws its noise from its own generator: its tokens do not depend on the rest of the batch.

Order per row: grammar mask (structured outputs), logit_bias, penalties, then temperature,
top-k/top-p/min-p. Logprobs are those of the raw model distribution, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.outputs import TokenLogprob
from workers.engine.sampling_params import SamplingParams
from workers.runner import token_mask
from workers.runner.token_mask import TokenMask

TOP_WINDOW = 1024


@dataclass
class SamplingRow:
    params: SamplingParams
    num_samples: int
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_output_tokens: int


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    num_drafts: int = 0  # a speculating row's proposals: token_ids kept some, plus one


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: list[int],
    mask: TokenMask | None = None,
) -> list[SampleResult]:
    """logits: [len(rows), vocab] float32. Returns one result per row (num_samples tokens).

    `mask` holds the allowed tokens of the constrained rows (indices into `rows`)."""
    if mask is not None:
        mask = _expand_mask(mask, rows)
    if any(row.num_samples != 1 for row in rows):
        index = torch.tensor(
            [i for i, row in enumerate(rows) for _ in range(row.num_samples)],
            device=logits.device,
        )
        logits = logits.index_select(0, index)
        flat = [row for row in rows for _ in range(row.num_samples)]
    else:
        flat = rows
    want_logprobs = [i for i, row in enumerate(flat) if row.params.logprobs is not None]
    raw_logprobs = (
        torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None
    )
    if mask is not None:
        token_mask.apply(logits, mask.rows, mask.bitmask)
    apply_logit_bias(logits, flat)
    apply_penalties(logits, flat, eos_token_ids)
    tokens = _choose(logits, flat)
    token_list = tokens.tolist()
    per_flat_logprobs: dict[int, TokenLogprob] = {}
    if raw_logprobs is not None:
        per_flat_logprobs = gather_logprobs(raw_logprobs, want_logprobs, flat, token_list)
    results, pos = [], 0
    for row in rows:
        span = range(pos, pos + row.num_samples)
        results.append(
            SampleResult(
                token_ids=[token_list[i] for i in span],
                logprobs=[per_flat_logprobs[i] for i in span]
                if row.params.logprobs is not None
                else None,
            )
        )
        pos += row.num_samples
    return results


def _expand_mask(mask: TokenMask, rows: list[SamplingRow]) -> TokenMask:
    """Row indices -> flat (per-sample) indices: the samples of a row share its mask."""
    starts, pos = [], 0
    for row in rows:
        starts.append(pos)
        pos += row.num_samples
    if pos == len(rows):
        return mask
    flat, picks = [], []
    for k, i in enumerate(mask.rows):
        flat.extend(range(starts[i], starts[i] + rows[i].num_samples))
        picks.extend([k] * rows[i].num_samples)
    index = torch.tensor(picks, device=mask.bitmask.device)
    return TokenMask(flat, mask.bitmask.index_select(0, index))


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            ids = torch.tensor([t for t in bias if t < vocab], device=logits.device)
            values = torch.tensor([v for t, v in bias.items() if t < vocab],
                                  device=logits.device, dtype=logits.dtype)
            logits[i].index_add_(0, ids, values)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], eos: list[int]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if p.uses_penalties:
            _penalize(logits[i], row, vocab)
        # a grammar decides where constrained output ends: min_tokens cannot outvote it
        if row.num_output_tokens < p.min_tokens and p.structured is None:
            banned = [t for t in [*eos, *p.stop_token_ids] if t < vocab]
            logits[i, banned] = float("-inf")


def _penalize(row_logits: torch.Tensor, row: SamplingRow, vocab: int) -> None:
    p = row.params
    device = row_logits.device
    if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        out_ids = torch.tensor(row.output_token_ids, device=device)
        counts = torch.bincount(out_ids, minlength=vocab).to(row_logits.dtype)
        row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
            device=device, dtype=torch.long,
        )
        if seen.numel():
            values = row_logits[seen]
            row_logits[seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`, the same first maximum's index (NaN counting as the maximum), by
    `max`'s kernel: on CPU argmax's reduction is the slower one (64 x 49,152 float32 logits on
    two cores: 2.1 against 0.8 ms, a step's worth of sampling at batch 64)."""
    return x.max(dim=-1).indices


def _choose(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    tokens = row_argmax(logits)
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not random_rows:
        return tokens
    probs = target_probs(logits[random_rows], [rows[i].params for i in random_rows])
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        noise[j].exponential_(generator=rows[i].generator)
    tokens[random_rows] = row_argmax(probs / noise)
    return tokens


def target_probs(logits: torch.Tensor, params: list[SamplingParams], *,
                 normalize: bool = False) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, top-k/top-p, then
    min-p. Rows cut by min-p sum to less than one unless `normalize` (the race in `_choose`
    does not need it; speculative verification reads absolute probabilities)."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    logits = logits / temps
    if any(p.top_k or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
    if bool((min_ps > 0).any()):
        probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
        if normalize:
            probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside each row's top_k and its top_p nucleus (top-p after top-k).

    A full sort of the vocabulary costs milliseconds per row on CPU, so rows are first served
    from a top-`TOP_WINDOW` window; only a row whose nucleus does not fit the window (a very
    flat distribution) pays for the full sort. The result is the same either way.
    """
    width = max(TOP_WINDOW, *(p.top_k for p in params))
    result, fits = _masked_window(logits, params, width)
    untouched = [i for i, p in enumerate(params) if not p.top_k and p.top_p >= 1.0]
    if untouched:
        result[untouched] = logits[untouched]
    flat = [i for i, ok in enumerate(fits) if not ok and i not in untouched]
    if flat:
        vocab = logits.shape[-1]
        result[flat] = _masked_window(logits[flat], [params[i] for i in flat], vocab)[0]
    return result


def _masked_window(
    logits: torch.Tensor, params: list[SamplingParams], width: int
) -> tuple[torch.Tensor, list[bool]]:
    """Apply the masks within the `width` best tokens; say per row whether that was enough.

    With `width` equal to the vocabulary this is the plain full-sort computation.
    """
    vocab = logits.shape[-1]
    device = logits.device
    width = min(width, vocab)
    values, order = logits.topk(width, dim=-1)  # sorted, descending
    ks = torch.tensor([p.top_k or vocab for p in params], device=device).unsqueeze(1)
    top_ps = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    values = values.masked_fill(torch.arange(width, device=device) >= ks, float("-inf"))
    k_in_window = ks <= width
    norm = torch.where(  # top-p renormalises over the top-k set, else the whole vocabulary
        k_in_window,
        torch.logsumexp(values, dim=-1, keepdim=True),
        torch.logsumexp(logits, dim=-1, keepdim=True),
    )
    probs = torch.exp(values - norm)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    values = values.masked_fill(before >= top_ps, float("-inf"))
    result = torch.full_like(logits, float("-inf")).scatter(-1, order, values)
    fits = k_in_window | (probs.sum(dim=-1, keepdim=True) >= top_ps)
    return result, fits.squeeze(1).tolist()


def gather_logprobs(
    raw: torch.Tensor, flat_rows: list[int], rows: list[SamplingRow], tokens: list[int]
) -> dict[int, TokenLogprob]:
    chosen_ids = torch.tensor([tokens[i] for i in flat_rows], device=raw.device)
    chosen = raw.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    k = max(rows[i].params.logprobs or 0 for i in flat_rows)
    top_values, top_ids = raw.topk(max(k, 1), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    result = {}
    for j, i in enumerate(flat_rows):
        n = rows[i].params.logprobs or 0
        result[i] = TokenLogprob(
            token_id=tokens[i],
            logprob=chosen[j],
            top=list(zip(top_ids[j][:n], top_values[j][:n], strict=True)),
        )
    return result
