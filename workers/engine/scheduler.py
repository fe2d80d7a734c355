"""Iteration-level scheduling under one token budget; no prefill or decode phases.

Each step first gives running sequences what they need (one token for a decode, the next
chunk for a prompt being prefilled), then admits waiting ones with chunks of what is left.
When blocks run out the lowest-priority, newest running sequence is preempted and will be
recomputed, so the oldest work always progresses and nothing deadlocks.

Background sequences (the lowest priority, `BACKGROUND_PRIORITY`: batch lines) run in what
foreground ones leave: they are admitted only when no foreground request waits that could
start, their chunks come after every foreground chunk of the step (so a foreground request
admitted this step prefills first), and they give up seats and blocks to foreground ones
before any foreground sequence is preempted.

With LoRA, running requests use at most `max_loras` distinct adapters (pinned ones count
too), so every running adapter has a device slot and none is ever evicted while in use. A
waiting request whose adapter does not fit is passed over, not waited on.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.engine.block_manager import BlockManager
from workers.engine.fair_share import FairQueue, FairShare
from workers.engine.queue_policy import PriorityFCFSQueue
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.speculative import NgramIndex, SpeculativeConfig
from workers.engine.step_cost import StepCost, StepRoom
from workers.engine.structured import TokenMatcher


@dataclass
class ScheduledChunk:
    """Tokens of one sequence to compute this step, and whether to sample after them."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_samples: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_output_tokens: int
    seed: int | None
    lora_id: int | None = None
    lora_slot: int = -1  # set by the engine once slots are assigned; -1 is the base model
    grammar: TokenMatcher | None = None  # the sequence's matcher, on sampling chunks only
    # speculative decoding: the proposed tokens, the tail of `token_ids`; every position of
    # the chunk is scored and the sampler keeps what the model agrees with
    draft_token_ids: list[int] = field(default_factory=list)
    # method "draft": slots reserved for proposals the runner's draft model makes this step
    # (it fills draft_token_ids), and the sequence's tokens for the draft to catch up on
    num_draft_slots: int = 0
    context_token_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)  # (slot, adapter) copies

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_waiting: int = 4096
    max_loras: int = 0  # distinct adapters among running requests; 0 = LoRA off
    # The most prompt tokens one request may prefill in a step (0: no cap), alone or not (as
    # vLLM's): a long prompt advances in chunks of this size, so no step is longer than one
    # chunk and a request that arrives meanwhile waits at most that, then is served beside
    # it. While requests wait, running prefills together leave this much of the budget to
    # them.
    long_prefill_token_threshold: int = 0
    # "fair": waiting requests are admitted least-served tenant first (`FairShare`), and
    # memory pressure preempts the most-served tenant's newest request; "fcfs": priority,
    # then arrival, for admission and (reversed) for preemption.
    policy: str = "fair"
    speculative: SpeculativeConfig | None = None  # None: no proposals
    # While two or more tenants have had work within `sharing_window_s`, prompt chunks in one
    # step may cost at most this many seconds at the measured speed (`StepCost`; 0: no
    # limit), so one tenant's long prompts cannot keep another's request waiting for a long
    # step. Decode rows always run; the first prompt chunk of a step gets at least
    # `MIN_SHARED_CHUNK` tokens. One tenant alone is never limited.
    shared_step_s: float = 0.0
    sharing_window_s: float = 10.0
    attention_tokens: float = 0.0  # StepCost.attention_tokens for the model (0: not counted)
    # A waiting request whose whole prompt is at most this many tokens, of a tenant not ahead
    # by more than that of the other tenants in the step in flight, may run in a step of its
    # own between two of that step's layers (`schedule_interjection`; 0: never).
    interject_tokens: int = 0
    # While foreground sequences run, at most this many background ones decode in a step (0:
    # no limit; background prompt chunks are bounded by the budget foreground work leaves).
    # A decode step is bound by reading the weights once while it has few rows, so a handful
    # of batch rows costs a live token little; dozens would make every step compute-bound
    # and slow each live token. Past the limit the oldest background sequences decode and
    # the rest wait, keeping their blocks (foreground pressure preempts them first).
    background_decode_slots: int = 8


MIN_SHARED_CHUNK = 16
MAX_INTERJECT_PER_TENANT = 8  # waiting requests of one tenant an interjection looks at


POLICIES = ("fair", "fcfs")


@dataclass
class _Room:
    """What is left of one step while `schedule` hands it out."""

    budget: int  # tokens (and draft slots) for running sequences
    prefill: int  # prompt tokens running prefills may still take
    yielded: set[str | None]  # tenants whose prefills sit this step out (fair hold-back)
    speculate: bool
    shared: StepRoom


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 pinned_loras: set[int] | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.pinned_loras = pinned_loras if pinned_loras is not None else set()
        if config.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}")
        self.share = FairShare()  # charged under either policy, so /stats shows the split
        self.waiting: FairQueue | PriorityFCFSQueue = (
            FairQueue(self.share) if config.policy == "fair" else PriorityFCFSQueue())
        self.running: list[Sequence] = []
        self._finished_seq_ids: list[int] = []
        self.num_preemptions = 0
        self.cost = StepCost(config.attention_tokens)
        self.clock: Callable[[], float] = time.monotonic

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.share.arrive(seq)
        self.waiting.push(seq)

    def schedule(self) -> SchedulerOutput:
        """One step: running foreground sequences, then foreground admissions, then running
        background sequences with what is left, then background admissions if no foreground
        request is left waiting. Without background work this is the plain order: running
        first, then admissions."""
        out = SchedulerOutput(finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        background = {s.seq_id for s in self.running if s.is_background}
        budget = self.config.max_num_batched_tokens
        # With the cap on and requests waiting, running prefills leave room for one capped
        # chunk of admissions: several long prompts never take a whole step between them.
        cap = self.config.long_prefill_token_threshold
        room = _Room(
            budget=budget,
            prefill=budget - cap if cap and self._foreground_waiting() else budget,
            yielded=self._tenants_to_hold_back(),  # their prefills sit this step out
            speculate=self._speculation_pays(),
            shared=StepRoom(self.cost, self._shared_units(), MIN_SHARED_CHUNK),
        )
        self._schedule_running(0, True, out, room)
        active = self.active_loras()
        passed_over: list[Sequence] = []
        # memory is short for foreground work: admit nothing new this step
        foreground_done = (not any(i not in background for i in out.preempted_seq_ids)
                           and self._admit(False, out, room, active, passed_over))
        start = next((i for i, s in enumerate(self.running) if s.is_background),
                     len(self.running))
        if start < len(self.running):
            room.budget = self.config.max_num_batched_tokens - sum(
                c.num_tokens + c.num_draft_slots for c in out.chunks)
            room.prefill = room.budget - cap if cap and self.waiting else room.budget
            self._schedule_running(start, False, out, room)
        if foreground_done and not out.preempted_seq_ids:
            self._admit(True, out, room, active, passed_over)
        for seq in passed_over:
            self.waiting.push(seq)
        return out

    def _foreground_waiting(self) -> bool:
        """Whether a foreground request waits: both queues put them before background."""
        return bool(self.waiting) and not self.waiting.peek().is_background

    def _schedule_running(self, i: int, foreground: bool, out: SchedulerOutput,
                          room: _Room) -> None:
        """A chunk for each running sequence from `running[i]` on, foreground ones only or
        background ones only (background sequences sort last: the lowest priority)."""
        limit = self.config.background_decode_slots
        if foreground or not any(not s.is_background for s in self.running):
            limit = 0  # background decodes are limited only beside foreground work
        decodes = 0
        while i < len(self.running) and room.budget > 0:
            seq = self.running[i]
            if foreground and seq.is_background:
                break
            num_new = self._capped(min(seq.num_tokens - seq.num_computed_tokens, room.budget))
            if num_new > 1:  # a prefill chunk: within what is left of the prefill room
                num_new = min(num_new, max(room.prefill, 0))
                if seq.tenant in room.yielded:
                    num_new = 0  # a less-served tenant waits: its prompt goes first
                num_new = room.shared.take(num_new, seq.num_computed_tokens)
                room.prefill -= num_new
            elif num_new == 1:
                if limit and decodes >= limit:
                    num_new = 0  # enough background rows beside foreground work
                else:
                    decodes += 1
                    room.shared.charge(1, seq.num_computed_tokens)
            if num_new == 0:  # its next token has not been sampled yet, or no room left
                i += 1
                continue
            if not self._make_room(i, num_new, out):
                continue  # seq itself was preempted: running[i] is the next one now
            drafts = (self._propose(seq, room.budget - num_new)
                      if room.speculate and num_new == 1 else 0)
            out.chunks.append(self._allocate(seq, num_new, out, drafts))
            room.budget -= out.chunks[-1].num_tokens + out.chunks[-1].num_draft_slots
            i += 1

    def _admit(self, background: bool, out: SchedulerOutput, room: _Room, active: set[int],
               passed_over: list[Sequence]) -> bool:
        """Admit waiting sequences of one class in queue order while they can start. True
        when none of that class is left to try; False when one could not start (it and
        those after it wait for a later step)."""
        while self.waiting:
            budget = self.config.max_num_batched_tokens - out.num_batched_tokens
            if budget <= 0:
                return False
            seq = self.waiting.peek()
            if seq.is_background != background:
                return True  # the queue holds background work only now
            if seq.tenant in room.yielded:
                return False  # nor do their new prompts start in this step
            width = seq.sampling_params.n if seq.pending_forks else 1
            if (len(self.running) + width > self.config.max_num_seqs
                    and not self._free_a_seat(seq, width, out)):
                return False
            if not self._lora_fits(seq.lora_id, active):
                passed_over.append(self.waiting.pop())
                continue
            if not seq.block_table:  # new, or preempted: reuse what the prefix cache holds
                cached = self.block_manager.match_prefix(seq)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = cached
            num_new = self._capped(min(seq.num_tokens - seq.num_computed_tokens, budget))
            if num_new > 1:
                wanted = num_new
                num_new = room.shared.take(num_new, seq.num_computed_tokens)
                if num_new < min(wanted, MIN_SHARED_CHUNK):
                    # the step is full, or has room for a sliver only (which would leave it
                    # running behind others' prefills): it starts next step
                    self.block_manager.free(seq)
                    return False
            if not self._admit_room(seq, num_new, out):
                self.block_manager.free(seq)  # hand the matched blocks back (still cached)
                return False
            self.waiting.pop()
            seq.status = SequenceStatus.RUNNING
            out.chunks.append(self._allocate(seq, num_new, out))
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            if seq.lora_id is not None:
                active.add(seq.lora_id)
        return True

    def schedule_interjection(self, in_flight: SchedulerOutput) -> SchedulerOutput:
        """A step run while `in_flight` is paused between two layers, for waiting requests
        that need nobody else's room (fair policy only). A request qualifies when `in_flight`
        holds another tenant's work and its tenant is served at most `interject_tokens` more
        than the least served of those others (so interjecting again and again cannot take
        more than a fair share; a tenant alone in the step waits for its end), its whole
        prompt fits `interject_tokens` with the others taken, and free blocks, a seat and an
        adapter slot are there without preempting anyone (seats past `max_num_seqs`:
        `_may_overfill`). Running sequences are not touched: the step in flight owns their
        blocks. Background requests never interject; background chunks in flight bound no
        one: with no other tenant's foreground work in the step, any foreground request of a
        tenant may interject (foreground goes first, whatever the tenants' service)."""
        out = SchedulerOutput()
        if not isinstance(self.waiting, FairQueue) or not self._foreground_waiting():
            return out
        live = {s.seq_id: s for s in self.running}
        in_step = [live[c.seq_id] for c in in_flight.chunks if c.seq_id in live]
        stepping = {s.tenant: self.share.counter(s) for s in in_step if not s.is_background}
        behind_background = any(s.is_background for s in in_step)
        budget = self.config.interject_tokens

        def ceiling(tenant: str | None) -> float:
            others = [counter for t, counter in stepping.items() if t != tenant]
            if others:
                return min(others) + self.config.interject_tokens
            return math.inf if behind_background else -math.inf

        active = self.active_loras()
        seats = Counter(s.tenant for s in self.running)
        for seq in self.waiting.candidates(ceiling, MAX_INTERJECT_PER_TENANT):
            if seq.is_background:
                continue
            width = seq.sampling_params.n if seq.pending_forks else 1
            over = len(self.running) + width > self.config.max_num_seqs
            if ((over and not self._may_overfill(seq.tenant, seats[seq.tenant], width))
                    or not self._lora_fits(seq.lora_id, active)
                    or seq.num_tokens > budget + self.block_manager.block_size * (
                        (seq.num_tokens - 1) // self.block_manager.block_size)):
                continue  # no seat or slot; or too long even if all but its tail is cached
            cached = self.block_manager.match_prefix(seq)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget or not self.block_manager.can_allocate_slots(seq, num_new):
                self.block_manager.free(seq)  # hand the matched blocks back (still cached)
                continue
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            out.chunks.append(self._allocate(seq, num_new, out))
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            seats[seq.tenant] += width
            if seq.lora_id is not None:
                active.add(seq.lora_id)
            budget -= num_new
            if budget <= 0:
                break
        return out

    def _may_overfill(self, tenant: str | None, seats: int, width: int) -> bool:
        """Whether an interjection may seat `width` more of `tenant`'s sequences past
        `max_num_seqs`: a tenant with no seat may take one (a step would preempt the
        most-served tenant's newest for it, `_free_a_seat`), and one below its weighted share
        of the seats may fill up to it. The excess drains as sequences finish, since
        admissions wait until the count is back under."""
        if seats == 0 and width == 1:
            return True
        return seats + width <= self.share.seat_share(tenant, self.config.max_num_seqs)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine reports how long the runner took over `out`: the speed `shared_step_s`
        is turned into token-equivalents with."""
        self.cost.observe(sum(self.cost.of_chunk(c.num_tokens, c.start_pos)
                              for c in out.chunks), seconds)

    def _shared_units(self) -> float | None:
        """Units the step may spend while tenants share the engine (None: no limit)."""
        if self.config.shared_step_s <= 0 or not self.share.sharing(
                self.clock(), self.config.sharing_window_s):
            return None
        return self.cost.units_in(self.config.shared_step_s)

    def _free_a_seat(self, seq: Sequence, width: int, out: SchedulerOutput) -> bool:
        """When every seat (`max_num_seqs`) is taken. A foreground `seq` takes background
        sequences' seats first, newest first, under either policy, where that is enough.
        Else, under `fair` and when `seq`'s tenant has none: preempt the most-served tenant's
        newest sequence for it (background ones first; a background `seq` only ever takes a
        background seat). A tenant with a seat waits its turn, so this happens at most once
        per tenant that finds itself shut out, never back and forth."""
        seats = self.config.max_num_seqs - width
        if not seq.is_background and sum(
                not s.is_background for s in self.running) <= seats:
            while len(self.running) > seats:  # the tail is background: the lowest priority
                self._preempt(self.running.pop(), out)
            return True
        if self.config.policy != "fair" or any(s.tenant == seq.tenant for s in self.running):
            return False
        level = self.share.counter(seq)

        def may_take(s: Sequence) -> bool:
            if s.is_background and not seq.is_background:
                return True
            return self.share.counter(s) > level and (s.is_background or not seq.is_background)

        while len(self.running) > seats:
            served = [j for j, s in enumerate(self.running) if may_take(s)]
            if not served:
                return False
            victim = max(served, key=lambda j: (self.running[j].is_background,
                                                self.share.counter(self.running[j]),
                                                self.running[j].sort_key))
            self._preempt(self.running.pop(victim), out)
        return True

    def _tenants_to_hold_back(self) -> set[str | None]:
        """Under `fair`, when the request admitted next can start this step: the running
        tenants served more than its tenant. Their prefill chunks (and new prompts) sit this
        step out, so a light tenant's short prompt runs in a short step, not beside them."""
        if self.config.policy != "fair" or not self._foreground_waiting():
            return set()  # nothing is held back for background work
        seq = self.waiting.peek()
        if (len(self.running) >= self.config.max_num_seqs
                and any(s.tenant == seq.tenant for s in self.running)):
            return set()  # no seat for it this step (one is freed only for the seatless)
        first = self._capped(min(seq.num_tokens - seq.num_computed_tokens,
                                 self.config.max_num_batched_tokens))
        if (not self._lora_fits(seq.lora_id, self.active_loras())
                or not self.block_manager.can_allocate_slots(seq, first)):
            return set()  # it could not start now: holding back would only stall the others
        level = self.share.counter(seq)
        return {s.tenant for s in self.running
                if s.tenant != seq.tenant and self.share.counter(s) > level}

    def _speculation_pays(self) -> bool:
        spec = self.config.speculative
        return spec is not None and sum(
            1 for s in self.running if s.num_computed_tokens + 1 == s.num_tokens
        ) <= spec.max_batch

    def _propose(self, seq: Sequence, room: int) -> list[int] | int:
        """Draft tokens for a decoding sequence (prompt lookup), or the number of slots for
        the runner's draft model: none for rows whose next-token rule depends on the tokens
        before it in ways the sampler does not replay per position (penalties), nor where
        they would not fit the budget, `max_tokens` or the free blocks (a proposal never
        preempts anyone). Grammar rows do speculate: the runner masks each position as if
        the proposals before it were kept."""
        spec = self.config.speculative
        params = seq.sampling_params
        if (spec is None or seq.num_output_tokens == 0 or seq.pending_forks
                or seq.num_computed_tokens + 1 != seq.num_tokens or params.uses_penalties):
            return []
        if seq.spec_rest:  # its recent proposals all missed (speculative.back_off)
            seq.spec_rest -= 1
            return []
        k = spec.num_tokens
        if params.speculative_tokens is not None:
            k = min(k, params.speculative_tokens)
        k = min(k, room, (params.max_tokens or 0) - seq.num_output_tokens - 1)
        if k <= 0:
            return []
        if spec.method == "draft":
            while k and not self.block_manager.can_allocate_slots(seq, 1 + k):
                k -= 1
            return k
        if seq.ngram is None:
            seq.ngram = NgramIndex(spec.ngram_min, spec.ngram_max)
        drafts = seq.ngram.propose(seq.token_ids, k)
        while drafts and not self.block_manager.can_allocate_slots(seq, 1 + len(drafts)):
            drafts.pop()
        return drafts

    def _capped(self, num_new: int) -> int:
        """A prompt chunk cut to `long_prefill_token_threshold`."""
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if cap > 0 else num_new

    def active_loras(self) -> set[int]:
        """Adapters of running requests: they hold device slots."""
        return {s.lora_id for s in self.running if s.lora_id is not None}

    def _lora_fits(self, lora_id: int | None, active: set[int]) -> bool:
        if lora_id is None or lora_id in active:
            return True
        return len(active | self.pinned_loras | {lora_id}) <= self.config.max_loras

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` beside `parent`, sharing all of its KV blocks."""
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.share.arrive(child)
        bisect.insort(self.running, child, key=lambda s: s.sort_key)

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out (done or aborted) and free its blocks now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.share.leave(seq, self.clock())
        self.block_manager.free(seq)
        self._finished_seq_ids.append(seq.seq_id)

    def _make_room(self, index: int, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt until `running[index]` fits; False if it had to go itself.

        Victims come from `running[index:]` (not yet scheduled this step): background ones
        first, newest first (the tail); then under `fcfs` the tail (lowest priority, newest),
        under `fair` the most-served tenant's lowest-priority, newest sequence."""
        seq = self.running[index]
        while not self.block_manager.can_allocate_slots(seq, num_new):
            victim = self.running.pop(self._victim_index(index))
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _victim_index(self, start: int) -> int:
        if self.config.policy == "fcfs" or self.running[-1].is_background:
            return len(self.running) - 1
        candidates = range(start, len(self.running))
        return max(candidates, key=lambda j: (self.share.counter(self.running[j]),
                                              self.running[j].sort_key))

    def _admit_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Fit a waiting sequence, preempting only running ones of strictly lower priority,
        from the tail: background ones first (a background sequence preempts nothing)."""
        while not self.block_manager.can_allocate_slots(seq, num_new):
            if not self.running or self.running[-1].priority <= seq.priority:
                return False
            self._preempt(self.running.pop(), out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            if chunk.seq_id == seq.seq_id:  # scheduled this step, now dropped: not computed
                seq.num_computed_tokens -= chunk.num_tokens + chunk.num_draft_slots
        out.chunks = [chunk for chunk in out.chunks if chunk.seq_id != seq.seq_id]
        self.block_manager.free(seq)
        self.waiting.push(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        out.preempted_seq_ids.append(seq.seq_id)

    def _allocate(self, seq: Sequence, num_new: int, out: SchedulerOutput,
                  drafts: list[int] | int = 0) -> ScheduledChunk:
        """Slots for `num_new` tokens and any proposals after them (tokens, or a number of
        slots for the runner's draft model), which count as computed until the engine keeps
        or rolls them back after the step."""
        slots = drafts if isinstance(drafts, int) else 0
        drafts = [] if isinstance(drafts, int) else drafts
        width = num_new + len(drafts) + slots
        out.blocks_to_copy.extend(self.block_manager.allocate_slots(seq, width))
        start = seq.num_computed_tokens
        num_prompt = max(0, min(seq.num_prompt_tokens, start + num_new) - start)
        self.share.charge(seq, num_prompt, width - num_prompt)
        seq.num_computed_tokens += width
        reaches_end = start + num_new == seq.num_tokens
        num_samples = 0
        if reaches_end:
            num_samples = seq.sampling_params.n if seq.pending_forks else 1
        history = num_samples > 0 and seq.sampling_params.uses_penalties
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[start : start + num_new] + drafts,
            start_pos=start,
            block_table=seq.block_table,
            num_samples=num_samples,
            sampling_params=seq.sampling_params,
            prompt_token_ids=seq.prompt_token_ids if history else [],
            output_token_ids=seq.output_token_ids if history else [],
            num_output_tokens=seq.num_output_tokens,
            seed=seq.seed,
            lora_id=seq.lora_id,
            grammar=seq.grammar if num_samples else None,
            draft_token_ids=drafts,
            num_draft_slots=slots,
            context_token_ids=seq.token_ids if slots else None,
        )
