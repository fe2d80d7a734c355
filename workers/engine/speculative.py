"""Speculative decoding settings and the prompt-lookup (n-gram) proposer.

A speculating sequence's decode step carries its last token plus `k` proposed tokens; the
runner scores all `k + 1` positions in the same flattened step as every other row and the
sampler keeps the longest prefix the target model agrees with (`runner/rejection.py`), plus
one token of its own. Two proposers:
- "ngram" (prompt lookup) costs no model: the `k` tokens that followed the latest earlier
  occurrence of the sequence's last n tokens (longest n first), in the prompt or the output.
  Summaries, edits and code that quote their input are where that pays. Proposed here.
- "draft": a smaller model of the same vocabulary, run by the runner at the start of the step
  (`runner/draft.py`); the scheduler only reserves the `k` slots.

Pure Python, no torch: the scheduler proposes while it schedules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.sampling_params import InvalidRequestError

if TYPE_CHECKING:  # sequence.py imports NgramIndex from here
    from workers.engine.sequence import Sequence

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_tokens` proposed per step (k); proposals off once more than `max_batch` rows
    decode in one step, where the batch alone keeps the cores busy and the extra positions
    cost more than they save (docs/benchmarks.md "Speculative decoding")."""

    method: str = "ngram"
    num_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch: int = 16
    draft_model: str | None = None  # method "draft": a folder of a model of the same vocab

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative draft_model is needed by, and only by, method 'draft'")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError("speculative num_tokens must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError("speculative n-gram sizes need 1 <= ngram_min <= ngram_max <= 16")
        if self.max_batch < 1:
            raise ValueError("speculative max_batch must be at least 1")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """From `LLM(speculative={"method": "ngram", "num_tokens": 4})` or a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("speculative must be a mapping such as {'method': 'ngram'}")
        unknown = sorted(set(value) - {"method", "num_tokens", "ngram_min", "ngram_max",
                                       "max_batch", "draft_model"})
        if unknown:
            raise ValueError(f"unknown speculative settings: {', '.join(unknown)}")
        return cls(**value)


def check_request_tokens(value: int | None, config: SpeculativeConfig | None) -> None:
    """A request may lower k (0 turns speculation off for it), never raise it."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError("speculative_tokens must be a non-negative integer",
                                  param="speculative_tokens")
    limit = config.num_tokens if config is not None else 0
    if value > limit:
        raise InvalidRequestError(
            f"speculative_tokens={value} exceeds this engine's {limit} (speculative "
            f"{'off' if config is None else config.method})", param="speculative_tokens")


class NgramIndex:
    """Where each n-gram of a sequence first and last ended, kept up to date as tokens are
    appended (O(ngram sizes) per token, so a long prompt is indexed once, not searched every
    step)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.num_indexed = 0
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (first, last) end
        self._matches: dict[int, tuple[int, int]] = {}  # n -> the tail's earlier ends

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the sequence's tail:
        its latest occurrence, unless that one is too close to the tail to be followed by
        `k` tokens (a repeating run), then its first."""
        self._extend(token_ids)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            match = self._matches.get(n)
            if match is not None:
                first, latest = match
                end = latest if len(token_ids) - 1 - latest >= k else first
                return token_ids[end + 1 : end + 1 + k]
        return []

    def _extend(self, token_ids: list[int]) -> None:
        last = len(token_ids) - 1
        if self.num_indexed > len(token_ids):  # not the sequence it indexed: start over
            self.num_indexed, self._ends = 0, {}
        for j in range(self.num_indexed, len(token_ids)):
            for n in range(self.ngram_min, min(self.ngram_max, j + 1) + 1):
                key = tuple(token_ids[j + 1 - n : j + 1])
                seen = self._ends.get(key)
                self._ends[key] = (j, j) if seen is None else (seen[0], j)
                if j == last:
                    if seen is None:
                        self._matches.pop(n, None)
                    else:
                        self._matches[n] = seen
        self.num_indexed = len(token_ids)


MAX_REST = 7


def back_off(seq: Sequence, num_kept: int) -> None:
    """After a verification: a sequence whose proposals keep missing sits out proposals for
    0, 1, 3, then 7 decode steps after its 1st, 2nd, 3rd and later misses in a row, so text
    that does not repeat stops paying for proposals; one kept proposal resets it."""
    if num_kept:
        seq.spec_misses = 0
        return
    seq.spec_misses += 1
    seq.spec_rest = min((1 << (seq.spec_misses - 1)) - 1, MAX_REST)


class SpecStats:
    """Proposed and kept tokens, in total and by position (the i-th proposal of a step is
    only kept if the ones before it were)."""

    def __init__(self) -> None:
        self.proposed: list[int] = []
        self.accepted: list[int] = []
        self.num_steps = 0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        grow = num_proposed - len(self.proposed)
        if grow > 0:
            self.proposed.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for i in range(num_proposed):
            self.proposed[i] += 1
        for i in range(num_accepted):
            self.accepted[i] += 1
        self.num_steps += 1

    def figures(self) -> dict[str, float]:
        """For the engine's stats: totals, the rate, and `spec_position_<i>_*` per position."""
        proposed, accepted = sum(self.proposed), sum(self.accepted)
        out: dict[str, float] = {
            "spec_proposed_tokens": proposed,
            "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
        }
        for i, (p, a) in enumerate(zip(self.proposed, self.accepted, strict=True), start=1):
            out[f"spec_position_{i}_proposed"] = p
            out[f"spec_position_{i}_accepted"] = a
        return out
