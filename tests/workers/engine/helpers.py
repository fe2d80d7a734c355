"""Build sequences for pure-Python scheduler and block manager tests."""

from __future__ import annotations

import itertools

from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

_ids = itertools.count()


def make_seq(
    num_prompt: int, *, priority: int = 0, n: int = 1, max_tokens: int = 16,
    seq_id: int | None = None, tenant: str | None = None, weight: float = 1.0,
) -> Sequence:
    sid = next(_ids) if seq_id is None else seq_id
    seq = Sequence(
        seq_id=sid,
        request_id=f"r{sid}",
        token_ids=list(range(1, num_prompt + 1)),
        num_prompt_tokens=num_prompt,
        sampling_params=SamplingParams(n=n, max_tokens=max_tokens),
        arrival_order=sid,
        priority=priority,
        tenant=tenant,
        weight=weight,
    )
    seq.pending_forks = n - 1
    return seq
