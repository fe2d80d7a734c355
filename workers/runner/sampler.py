"""Turn the logits of each sampling row into tokens, per the row's own SamplingParams.

Sampling uses the exponential-race trick (argmax of p / Exp(1) noise) so each seeded row
draws its noise from its own generator: its tokens do not depend on the rest of the batch.

Order per row: grammar mask (structured outputs), logit_bias, penalties, then temperature,
top-k/top-p/min-p. Logprobs are those of the raw model distribution, as in vLLM.

Per-row settings reach the device as one tensor per step each (`to_device`: a non-blocking
copy), and per-row work is batched over the rows that need it: `torch.tensor(values,
device=cuda)` copies synchronously, a wait for the device each time, which per row cost a
step a wait per penalised or biased row. The step's one wait is for its tokens (`tolist`).
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


def to_device(values: list[int] | list[float], device: torch.device,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list on `device` without waiting for the device (`torch.tensor(values,
    device=...)` would)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: list[int],
    mask: TokenMask | None = None,
) -> list[SampleResult]:
    """logits: [len(rows), vocab] float32. Returns one result per row (num_samples tokens).

    `mask` holds the allowed tokens of the constrained rows (indices into `rows`)."""
    if mask is not None:
        mask = _expand_mask(mask, rows)
    if any(row.num_samples != 1 for row in rows):
        index = to_device([i for i, row in enumerate(rows) for _ in range(row.num_samples)],
                          logits.device)
        logits = logits.index_select(0, index)
        flat = [row for row in rows for _ in range(row.num_samples)]
    else:
        flat = rows
    want_logprobs = [i for i, row in enumerate(flat) if row.params.logprobs is not None]
    raw_logprobs = (
        torch.log_softmax(select_rows(logits, want_logprobs), dim=-1) if want_logprobs else None
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
    index = to_device(picks, mask.bitmask.device)
    return TokenMask(flat, mask.bitmask.index_select(0, index))


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`x[rows]` (a copy), the index copied without a wait (`x[list]` copies it
    synchronously); `x` itself where the rows are all of it, in order."""
    if rows == list(range(x.shape[0])):
        return x
    return x.index_select(0, to_device(rows, x.device))


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Every biased row's `logit_bias` added in one scatter."""
    vocab = logits.shape[-1]
    at_rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token, value in (row.params.logit_bias or {}).items():
            if token < vocab:
                at_rows.append(i)
                ids.append(token)
                values.append(value)
    if ids:
        device = logits.device
        logits.index_put_((to_device(at_rows, device), to_device(ids, device)),
                          to_device(values, device, logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], eos: list[int]) -> None:
    """Frequency, presence and repetition penalties over the rows that have them, and the
    `min_tokens` ban (EOS and stop ids at -inf): each a few ops for all rows at once."""
    vocab = logits.shape[-1]
    penalized = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if penalized:
        _penalize(logits, penalized, [rows[i] for i in penalized], vocab)
    at_rows: list[int] = []
    banned: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        # a grammar decides where constrained output ends: min_tokens cannot outvote it
        if row.num_output_tokens < p.min_tokens and p.structured is None:
            ids = sorted({t for t in [*eos, *p.stop_token_ids] if t < vocab})
            at_rows.extend([i] * len(ids))
            banned.extend(ids)
    if banned:
        device = logits.device
        logits.index_put_((to_device(at_rows, device), to_device(banned, device)),
                          torch.full((len(banned),), float("-inf"), device=device,
                                     dtype=logits.dtype))


def _penalize(logits: torch.Tensor, index: list[int], rows: list[SamplingRow],
              vocab: int) -> None:
    """logits[index[j]] -= frequency * count + presence * (count > 0) over row j's output
    tokens; then its tokens seen in prompt or output are divided (positive logits) or
    multiplied (negative) by its repetition penalty. A row's zero penalties and a penalty of
    1.0 leave its logits exactly as they were."""
    device = logits.device
    n = len(rows)
    at = to_device(index, device)
    part = logits.index_select(0, at)
    counted = [j for j, r in enumerate(rows) if r.output_token_ids
               and (r.params.presence_penalty or r.params.frequency_penalty)]
    if counted:
        flat_rows = [j for j in counted for _ in rows[j].output_token_ids]
        tokens = [t for j in counted for t in rows[j].output_token_ids]
        counts = torch.zeros(n, vocab, dtype=logits.dtype, device=device)
        counts.index_put_((to_device(flat_rows, device), to_device(tokens, device)),
                          torch.ones(len(tokens), dtype=logits.dtype, device=device),
                          accumulate=True)
        frequency = to_device([r.params.frequency_penalty for r in rows], device, logits.dtype)
        presence = to_device([r.params.presence_penalty for r in rows], device, logits.dtype)
        part -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    repeated = [j for j, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if repeated:
        seen_rows: list[int] = []
        seen_tokens: list[int] = []
        for j in repeated:
            seen = set(rows[j].prompt_token_ids) | set(rows[j].output_token_ids)
            seen_rows.extend([j] * len(seen))
            seen_tokens.extend(seen)
        seen_mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        if seen_tokens:
            seen_mask[to_device(seen_rows, device), to_device(seen_tokens, device)] = True
        penalty = to_device([r.params.repetition_penalty for r in rows], device,
                            logits.dtype)[:, None]
        part = torch.where(seen_mask, torch.where(part > 0, part / penalty, part * penalty),
                           part)
    logits.index_copy_(0, at, part)


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
    probs = target_probs(select_rows(logits, random_rows),
                         [rows[i].params for i in random_rows])
    noise = torch.empty_like(probs)
    seeded = [rows[i].generator is not None for i in random_rows]
    if not all(seeded):  # unseeded rows share the default generator: one draw for all rows
        noise.exponential_()
    for j, i in enumerate(random_rows):  # a seeded row's noise is its own generator's
        if seeded[j]:
            noise[j].exponential_(generator=rows[i].generator)
    if len(random_rows) == len(rows):
        return row_argmax(probs / noise)
    return tokens.index_copy_(0, to_device(random_rows, tokens.device),
                              row_argmax(probs / noise))


def target_probs(logits: torch.Tensor, params: list[SamplingParams], *,
                 normalize: bool = False) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from: temperature, top-k/top-p, then
    min-p. Rows cut by min-p sum to less than one unless `normalize` (the race in `_choose`
    does not need it; speculative verification reads absolute probabilities)."""
    device = logits.device
    temps = to_device([p.temperature for p in params], device, torch.float32).unsqueeze(1)
    logits = logits / temps
    if any(p.top_k or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):  # asked of the params, not of the device
        min_ps = to_device([p.min_p for p in params], device, torch.float32).unsqueeze(1)
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
        at = to_device(untouched, logits.device)
        result.index_copy_(0, at, logits.index_select(0, at))
    flat = [i for i, ok in enumerate(fits) if not ok and i not in untouched]
    if flat:
        vocab = logits.shape[-1]
        at = to_device(flat, logits.device)
        result.index_copy_(0, at, _masked_window(logits.index_select(0, at),
                                                 [params[i] for i in flat], vocab)[0])
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
    ks = to_device([p.top_k or vocab for p in params], device).unsqueeze(1)
    top_ps = to_device([p.top_p for p in params], device, torch.float32).unsqueeze(1)
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
    chosen_ids = to_device([tokens[i] for i in flat_rows], raw.device)
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
