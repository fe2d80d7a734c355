"""The engine core: requests in, then `step()` = schedule -> run -> update, outputs out.

Shaped like vLLM v1's EngineCore and nano-vllm's engine: the scheduler decides what runs (a
`SchedulerOutput`), the runner runs it (a `SampleResult` per sampling sequence), and the
update appends the tokens, forks `n > 1` requests and ends what stopped; a step hands back
the `RequestOutput`s of the requests it moved (only what is new, for `output_kind="delta"`).
Everything else is a module of its own beside it: preparing requests
(`engine/input_processor.py`), what callers see (`engine/output_processor.py`), where
adapters live (`lora/residency.py`), steps run inside a step (`engine/interjection.py`) and
what a speculating step keeps (`engine/spec_acceptance.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

from workers.config import EngineArgs
from workers.engine.block_manager import BlockManager
from workers.engine.input_processor import InputProcessor
from workers.engine.interjection import (
    DEFAULT_INTERJECT_TOKENS,
    Arrivals,
    Interjections,
    interject_tokens,
)
from workers.engine.output_processor import request_output, text_stream
from workers.engine.outputs import RequestOutput, TokenLogprob
from workers.engine.prefix_hash import PrefixSummary
from workers.engine.request import PreparedRequest, Request, Sample
from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.engine.sequence import FinishReason, RequestMetrics, Sequence
from workers.engine.spec_acceptance import accept_verified
from workers.engine.speculative import SpecStats, SpeculativeConfig
from workers.engine.stats import engine_stats
from workers.engine.step_cost import attention_tokens
from workers.engine.stop_checker import StopChecker
from workers.lora.manager import AdapterStatus, LoRAManager
from workers.lora.residency import AdapterResidency

__all__ = ["DEFAULT_INTERJECT_TOKENS", "Arrivals", "EngineOverloadedError", "LLMEngine",
           "PreparedRequest"]

_interject_tokens = interject_tokens  # its former name here


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


class LLMEngine:
    def __init__(
        self, args: EngineArgs, tokenizer: Any, runner: Any, max_model_len: int,
        num_blocks: int, eos_token_ids: list[int], vocab_size: int,
    ) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.runner = runner
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.block_manager = BlockManager(num_blocks, args.block_size,
                                          enable_caching=args.enable_prefix_caching,
                                          window=getattr(runner, "kv_window", None))
        self.loras: LoRAManager | None = None
        if args.enable_lora:
            self.loras = LoRAManager(max_loras=args.max_loras,
                                     max_cpu_loras=args.max_cpu_loras or 4 * args.max_loras)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_waiting=args.max_waiting,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                policy=args.scheduling_policy,
                max_loras=args.max_loras if args.enable_lora else 0,
                speculative=SpeculativeConfig.parse(args.speculative),
                shared_step_s=args.shared_step_s,
                attention_tokens=attention_tokens(runner.model.config),
                interject_tokens=interject_tokens(args, runner),
                background_decode_slots=args.background_decode_slots,
            ),
            self.block_manager,
            self.loras.pinned_ids if self.loras else None,
        )
        config = self.scheduler.config
        self.inputs = InputProcessor(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
                                     max_model_len=max_model_len,
                                     max_num_seqs=config.max_num_seqs,
                                     speculative=config.speculative)
        self.adapters = AdapterResidency(self.loras, self.scheduler, runner, self.abort_request)
        self.interjections = Interjections(self)
        self.stops = StopChecker(eos_token_ids, max_model_len)
        # False when a caller reads parked adapters off the step loop (the async engine)
        self.read_adapters_in_step = True
        self._requests: dict[str, Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.spec_stats = SpecStats()
        self.arrivals: Arrivals | None = None  # None: no step runs inside another
        self.num_enqueued = 0

    @classmethod
    def from_args(cls, **kwargs: Any) -> LLMEngine:
        """Load tokenizer, config and weights (the default model when model is None)."""
        from workers.engine_loader import load_model

        args = EngineArgs.from_kwargs(**kwargs)
        model = load_model(args)
        return cls(args, model.tokenizer, model.runner, model.runner.max_model_len,
                   model.runner.num_blocks, model.eos_token_ids, model.vocab_size)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
        *, priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
        lora: str | None = None, tenant: str | None = None, weight: float = 1.0,
    ) -> None:
        """Queue a request. Lower `priority` values are served first within a tenant; between
        tenants the least served goes first, by `weight` (`fair_share.py`; FCFS under the
        `fcfs` policy).

        `cache_salt` names the prefix-cache namespace: requests only reuse KV computed under
        the same salt (the gateway passes the tenant). `lora` names a registered adapter."""
        self.check_capacity(0)
        prepared = self.prepare_request(prompt, params or SamplingParams(),
                                        cache_salt=cache_salt, lora=lora)
        prepared = dataclasses.replace(prepared, tenant=tenant, weight=weight)
        self.enqueue(request_id, prepared, priority=priority, arrival_time=arrival_time)

    def check_capacity(self, in_flight: int) -> None:
        """Refuse at once when the waiting queue is full, rather than queue without bound."""
        waiting = len(self.scheduler.waiting) + in_flight
        if waiting >= self.scheduler.config.max_waiting:
            raise EngineOverloadedError(f"engine overloaded: {waiting} requests already waiting")

    def prepare_request(
        self, prompt: str | list[int], params: SamplingParams, *, cache_salt: str | None = None,
        lora: str | None = None,
    ) -> PreparedRequest:
        """Tokenize and validate without touching engine state (safe from any thread)."""
        if lora is not None:
            self.adapters.require()
        return self.inputs.prepare(prompt, params, cache_salt=cache_salt, lora=lora)

    def grammars(self) -> Any:
        """The structured-outputs backend, built on first use (`InputProcessor.grammars`)."""
        return self.inputs.grammars()

    def enqueue(
        self, request_id: str, prepared: PreparedRequest, *, priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        token_ids, params = prepared.prompt_token_ids, prepared.params
        metrics = RequestMetrics(
            arrival_time=arrival_time or time.monotonic(), num_prompt_tokens=len(token_ids)
        )
        entry = self.adapters.lookup(prepared.lora)
        if params.structured is not None and prepared.grammar is None:
            raise InvalidRequestError("a structured request must come from prepare_request")
        request = Request(request_id, prepared.prompt, token_ids, params, metrics,
                          prepared.cache_salt, entry.lora_id if entry else None,
                          prepared.grammar, progress=prepared.progress,
                          tenant=prepared.tenant, weight=prepared.weight)
        seq = self._new_sequence(request, list(token_ids), 0, priority, next(self._arrivals))
        seq.pending_forks = params.n - 1
        self._requests[request_id] = request
        self.num_enqueued += 1
        self.adapters.admit(entry, seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output if it was live."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        for sample in request.samples:
            if not sample.seq.is_finished:
                sample.seq.finish_reason = FinishReason.ABORT
                self.scheduler.finish(sample.seq)
            self._seqs.pop(sample.seq.seq_id, None)
        self.adapters.release(request)
        request.metrics.finished_time = time.monotonic()
        return request_output(request, finished=True)

    def stop_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """End one sample of a live request as stopped (its caller matched a stop string in
        the text); its blocks are freed at once, the request's other samples go on."""
        request = self._requests.get(request_id)
        if request is None or index >= len(request.samples):
            return
        sample = request.samples[index]
        if sample.seq.is_finished:
            return
        sample.stop_reason = stop_reason
        sample.seq.finish_reason = FinishReason.STOP
        self.scheduler.finish(sample.seq)

    # ---- adapters (lora/residency.py) -----------------------------------------------------

    def add_lora(self, name: str, path: str, *, adapter: Any = None, pinned: bool = False) -> None:
        """Register an adapter (idempotent). Pass `adapter` when it was read off this thread."""
        self.adapters.add(name, path, adapter=adapter, pinned=pinned)

    def remove_lora(self, name: str, *, drain: bool = False) -> bool:
        """Forget an adapter; True once gone (`AdapterResidency.remove`)."""
        return self.adapters.remove(name, drain=drain)

    def cancel_unload(self, name: str) -> None:
        self.adapters.cancel_unload(name)

    def list_loras(self) -> list[AdapterStatus]:
        return self.adapters.status()

    def pending_lora_reads(self) -> list[tuple[str, str]]:
        """Adapters parked requests wait for: read them, then `put_lora` or `fail_lora`."""
        return self.adapters.pending_reads()

    def put_lora(self, name: str, adapter: Any) -> None:
        self.adapters.put(name, adapter)

    def fail_lora(self, name: str) -> list[str]:
        """The adapter could not be read back: abort its parked requests; their ids."""
        return self.adapters.fail(name)

    # ---- state ----------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    @property
    def num_interjections(self) -> int:
        return self.interjections.count

    @property
    def num_grammar_errors(self) -> int:
        """Samples failed: their grammar refused its own masked token."""
        return self.stops.num_grammar_errors

    def stats(self) -> dict[str, float]:
        """Load figures for routing and autoscaling (`engine/stats.py`)."""
        return engine_stats(self)

    def prefix_summary(self) -> PrefixSummary | None:
        """What the prefix cache holds, as a Bloom filter of block names (None: caching off)."""
        if not self.block_manager.enable_caching:
            return None
        return self.block_manager.summary()

    def tenant_tokens(self) -> dict[str | None, int]:
        """Tokens computed per tenant since start (prompt and output, recomputation too)."""
        return dict(self.scheduler.share.tokens)

    def has_schedulable_work(self) -> bool:
        """Something a step can run (requests parked on an adapter read are not)."""
        return self.scheduler.has_work

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule, run, update. With `arrivals` set, a short request of another
        tenant that arrives meanwhile is run between two of this step's layers
        (`engine/interjection.py`) and answered before this step ends."""
        if self.read_adapters_in_step:
            self.adapters.read_parked()
        sched = self.scheduler.schedule()
        return self.run(sched, self.interjections.hook(sched))

    def run(self, sched: SchedulerOutput,
            between_layers: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run a scheduled step and update from it. The scheduler learns how long the run
        took, less the steps run inside it (`between_layers`)."""
        self._note_scheduled(sched)
        paused = self.interjections.seconds
        started = time.perf_counter()
        results = self.runner.execute(sched, between_layers)
        elapsed = time.perf_counter() - started - (self.interjections.seconds - paused)
        self.scheduler.observe_step(sched, elapsed)
        return self._update(sched, results)

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        self.adapters.assign_slots(sched)
        now = time.monotonic()
        for chunk in sched.chunks:
            request = self._request_of(chunk.seq_id)
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            request.note_progress(self._seqs[chunk.seq_id])
        for seq_id in sched.preempted_seq_ids:
            self._request_of(seq_id).metrics.num_preemptions += 1

    def _update(self, sched: SchedulerOutput, results: dict[int, Any]) -> list[RequestOutput]:
        """Append the sampled tokens, fork `n > 1` requests after their prompt, end what
        stopped; the outputs of the requests this step moved, the finished ones let go."""
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq_id, result in results.items():
            seq = self._seqs[seq_id]
            request = self._requests[seq.request_id]
            touched[request.request_id] = request
            if result.num_drafts:
                accept_verified(seq, result, functools.partial(self._accept, request, seq, now),
                                stats=self.spec_stats, block_manager=self.block_manager,
                                metrics=request.metrics)
                continue
            tokens = result.token_ids
            logprobs = result.logprobs or [None] * len(tokens)
            children = self._fork(request, seq, tokens[1:]) if seq.pending_forks else []
            self._accept(request, seq, now, tokens[0], logprobs[0])
            for child, token, logprob in zip(children, tokens[1:], logprobs[1:], strict=True):
                self._accept(request, child, now, token, logprob)
        outputs = []
        for request in touched.values():
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
                self.adapters.release(request)
                del self._requests[request.request_id]
                for sample in request.samples:
                    self._seqs.pop(sample.seq.seq_id, None)
            outputs.append(request_output(request, finished=finished))
        return outputs

    def _fork(self, request: Request, parent: Sequence, first_tokens: list[int]) -> list[Sequence]:
        parent.pending_forks = 0
        children = []
        for index in range(1, len(first_tokens) + 1):
            child = self._new_sequence(
                request, list(parent.token_ids), index, parent.priority, parent.arrival_order
            )
            self.scheduler.fork(parent, child)
            children.append(child)
        return children

    def _accept(self, request: Request, seq: Sequence, now: float, token: int,
                logprob: TokenLogprob | None) -> None:
        """Append one token to a sample; end the sample if it stopped (`StopChecker`)."""
        seq.token_ids.append(token)
        sample = request.samples[seq.sample_index]
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if metrics.last_token_time != now:  # the first of this step's tokens for the request
            metrics.num_token_steps += 1
        metrics.last_token_time = now
        metrics.num_generation_tokens += 1
        if sample.logprobs is not None and logprob is not None:
            sample.logprobs.append(logprob)
        reason = self.stops.check(sample, token)
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)

    # ---- helpers --------------------------------------------------------------------------

    def _new_sequence(
        self, request: Request, token_ids: list[int], index: int, priority: int, arrival: int
    ) -> Sequence:
        params = request.params
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request.request_id,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
            sampling_params=params,
            arrival_order=arrival,
            priority=priority,
            sample_index=index,
            cache_salt=request.cache_salt,
            tenant=request.tenant,
            weight=request.weight,
            lora_id=request.lora_id,
            grammar=self.grammars().matcher(request.grammar) if request.grammar else None,
        )
        request.samples.append(Sample(
            seq, text_stream(self.tokenizer, request.prompt_token_ids, params),
            [] if params.logprobs is not None else None))
        self._seqs[seq.seq_id] = seq
        return seq

    def _request_of(self, seq_id: int) -> Request:
        return self._requests[self._seqs[seq_id].request_id]

