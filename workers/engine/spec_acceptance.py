"""Speculative acceptance: what a speculating sequence keeps of its verifying step.

The step scored the sequence's last token plus its `k` proposals in one pass; the sampler
kept the longest prefix of proposals the model agrees with, plus one token of its own
(`runner/rejection.py`). Here the sequence takes those tokens one by one, as a decode step
would have given them (so stop conditions end it on the right one), its KV past them is
rolled back, and the proposer's statistics and back-off learn how many were kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers.engine.block_manager import BlockManager
from workers.engine.outputs import TokenLogprob
from workers.engine.sequence import RequestMetrics, Sequence
from workers.engine.speculative import SpecStats, back_off


def accept_verified(seq: Sequence, result: Any, accept: Callable[[int, TokenLogprob | None], None],
                    *, stats: SpecStats, block_manager: BlockManager,
                    metrics: RequestMetrics) -> None:
    """Take a verifying step's tokens through `accept` (which may finish the sequence). The
    KV of the last token and of each kept proposal is valid; the rest is rolled back
    (`num_computed_tokens`, and the blocks past the tokens go back to the pool)."""
    tokens = result.token_ids
    stats.record(result.num_drafts, len(tokens) - 1)
    back_off(seq, len(tokens) - 1)
    logprobs = result.logprobs or [None] * len(tokens)
    seq.num_computed_tokens = seq.num_tokens  # through the step's first position
    for j, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        if j:
            seq.num_computed_tokens += 1  # the kept proposal before this token
            if seq.sample_index == 0:
                metrics.num_token_steps += 1  # a position of its own, for TPOT
        accept(token, logprob)
        if seq.is_finished:
            return
    block_manager.trim(seq)
