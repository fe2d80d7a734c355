"""A request as the engine holds it: what was prepared for it, then its samples.

Plain dataclasses, the handoffs between the input processor (which fills `PreparedRequest`
off the step loop), the engine core (which runs the samples' sequences) and the output
processor (which reads them to build outputs), so no one of those reaches into another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.outputs import TokenLogprob
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import PromptProgress, RequestMetrics, Sequence


@dataclass(frozen=True)
class PreparedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    lora: str | None = None  # a registered adapter's name; None is the base model
    grammar: Any = None  # params.structured, compiled (structured_backend); None: unconstrained
    progress: PromptProgress = field(default_factory=PromptProgress)  # the engine writes it
    tenant: str | None = None  # for the fair-share scheduler; None: the anonymous tenant
    weight: float = 1.0


@dataclass
class Sample:
    """One of a request's `n` samples: its sequence, and what its outputs have shown."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    stop_reason: str | int | None = None
    # what earlier outputs already held (delta outputs send only the rest)
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    cache_salt: str | None = None
    lora_id: int | None = None
    grammar: Any = None  # compiled; each sample gets its own matcher of it
    samples: list[Sample] = field(default_factory=list)
    progress: PromptProgress = field(default_factory=PromptProgress)
    tenant: str | None = None
    weight: float = 1.0

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.seq.is_finished for s in self.samples)

    def note_progress(self, seq: Sequence) -> None:
        """The prompt tokens computed so far (never fewer than before: a preempted request's
        recompute is not billed twice)."""
        progress = self.progress
        computed = min(seq.num_computed_tokens, len(self.prompt_token_ids))
        progress.num_computed_tokens = max(progress.num_computed_tokens, computed)
        progress.num_cached_tokens = max(progress.num_cached_tokens, seq.num_cached_tokens or 0)
