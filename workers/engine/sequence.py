"""One stream of tokens being generated: the unit the scheduler and block manager work on.

A request with `n > 1` starts as one sequence; once its prompt is computed it forks into n
sequences that share the prompt's KV blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.engine.sampling_params import SamplingParams
from workers.engine.speculative import NgramIndex
from workers.engine.structured import TokenMatcher

# The lowest priority (the bottom of the API's -10..10): a sequence at it is background work,
# as the gateway's batch lines are. The scheduler runs it only in what foreground sequences
# leave (admission, budget, seats, blocks), so a batch cannot slow live traffic.
BACKGROUND_PRIORITY = 10


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # The sample broke and its output is not to be trusted: its grammar (structured outputs)
    # refused the token sampled under its own mask. Never shown to clients as a finish:
    # `workers.client` turns it into a failed answer (a 500, `grammar_error`).
    ERROR = "error"


@dataclass
class PromptProgress:
    """How much of a request's prompt the engine has computed, readable from any thread.

    Written by the step loop as chunks are scheduled (a scheduled chunk always runs), so a
    request that ends before its first output token can still be billed for the work done."""

    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of those, served from the prefix cache


@dataclass
class RequestMetrics:
    """Timestamps from time.monotonic(); the derived figures are in seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # over all `n` samples
    num_token_steps: int = 0  # steps that gave this request tokens: one per position for any n
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, as a stream sees it: with `n > 1` the
        samples advance together, so the gap between positions counts, not tokens over all
        samples (which would make TPOT look `n` times better)."""
        if self.num_token_steps < 2 or self.first_token_time is None:
            return None
        assert self.last_token_time is not None
        return (self.last_token_time - self.first_token_time) / (self.num_token_steps - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    arrival_order: int
    priority: int = 0
    sample_index: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    pending_forks: int = 0
    cache_salt: str | None = None  # prefix-cache namespace: the tenant, unless shared on purpose
    tenant: str | None = None  # whose fair share of the engine it draws on (fair_share.py)
    weight: float = 1.0  # the tenant's weight in that share
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, in order
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    lora_id: int | None = None  # the adapter, by registration; None is the base model
    # structured outputs: advanced with every kept output token, so it survives preemption
    grammar: TokenMatcher | None = None
    ngram: NgramIndex | None = None  # speculative decoding's prompt-lookup index, built lazily
    spec_misses: int = 0  # speculative steps in a row that kept no proposal
    spec_rest: int = 0  # decode steps to sit out proposals (backoff after misses)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def seed(self) -> int | None:
        """Each sample of a seeded request draws from its own reproducible stream."""
        base = self.sampling_params.seed
        return None if base is None else base + self.sample_index

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Smaller runs first: higher priority (lower value), then arrival, then sample."""
        return (self.priority, self.arrival_order, self.sample_index)

    @property
    def is_background(self) -> bool:
        """Background work (`BACKGROUND_PRIORITY`): it yields to every foreground sequence."""
        return self.priority >= BACKGROUND_PRIORITY

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
