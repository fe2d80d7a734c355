"""The synchronous engine: add requests, then `step()` = schedule, run, update.

It owns the request bookkeeping (n > 1 forks, stop conditions, detokenizing, metrics) and
the adapters (`LoRAManager`); the scheduler decides what runs and the runner runs it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.config import EngineArgs
from workers.engine.block_manager import BlockManager
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from workers.engine.prefix_hash import PrefixSummary
from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.engine.sequence import FinishReason, PromptProgress, RequestMetrics, Sequence
from workers.engine.speculative import (
    SpecStats,
    SpeculativeConfig,
    back_off,
    check_request_tokens,
)
from workers.engine.step_cost import attention_tokens
from workers.lora.manager import AdapterStatus, LoRAManager

logger = logging.getLogger(__name__)
DEFAULT_INTERJECT_TOKENS = 256  # EngineArgs.interject_tokens on CPU


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


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
class _Sample:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    stop_reason: str | int | None = None
    # what earlier outputs already held (delta outputs send only the rest)
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    cache_salt: str | None = None
    lora_id: int | None = None
    grammar: Any = None  # compiled; each sample gets its own matcher of it
    samples: list[_Sample] = field(default_factory=list)
    progress: PromptProgress = field(default_factory=PromptProgress)
    tenant: str | None = None
    weight: float = 1.0

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.seq.is_finished for s in self.samples)


class Arrivals(Protocol):
    """Where requests that arrive while a step runs come from, and where the outputs of the
    steps run for them go (the async engine; see `LLMEngine.step`)."""

    def admit(self, engine: LLMEngine) -> None:
        """Enqueue (`engine.enqueue`) what has arrived since the step began."""
        ...

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams now, before the step in flight ends."""
        ...


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
                interject_tokens=_interject_tokens(args, runner),
            ),
            self.block_manager,
            self.loras.pinned_ids if self.loras else None,
        )
        # False when a caller reads parked adapters off the step loop (the async engine)
        self.read_adapters_in_step = True
        self._requests: dict[str, _Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._grammars: Any = None  # StructuredBackend, built for the first structured request
        self._grammars_lock = threading.Lock()
        self.spec_stats = SpecStats()
        self.arrivals: Arrivals | None = None  # None: no step runs inside another
        self.num_interjections = 0
        self.num_grammar_errors = 0  # samples failed: a grammar refused its own masked token
        self._interjected_s = 0.0
        self._num_enqueued = 0

    @classmethod
    def from_args(cls, **kwargs: Any) -> LLMEngine:
        """Load tokenizer, config and weights (the default model when model is None)."""
        from transformers import AutoConfig, AutoTokenizer

        from workers.model_files import resolve_model
        from workers.runner.model_runner import ModelRunner, RunnerConfig, pick_device, pick_dtype
        from workers.runner.models import check_model_folder

        args = EngineArgs.from_kwargs(**kwargs)
        folder = resolve_model(args.model)
        check_model_folder(folder)  # an unserved architecture: refused before anything loads
        hf_config = AutoConfig.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or folder)
        device = pick_device(args.device)
        eos = _eos_token_ids(hf_config, tokenizer)
        speculative = SpeculativeConfig.parse(args.speculative)
        draft = speculative.draft_model if speculative is not None else None
        runner = ModelRunner.load(
            RunnerConfig(
                model_path=folder,
                device=device,
                dtype=pick_dtype(args.dtype, device),
                block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory,
                kv_cache_fraction=args.kv_cache_fraction,
                max_model_len=args.max_model_len,
                max_loras=args.max_loras if args.enable_lora else 0,
                max_lora_rank=args.max_lora_rank,
                attention_backend=args.attention_backend,
                prefill_attention=args.prefill_attention,
                linear_backend=args.linear_backend,
                elementwise=args.elementwise,
                quantization=args.quantization,
                int8_compute=args.int8_compute,
                kv_cache_dtype=args.kv_cache_dtype,
                kv_huge_pages=args.kv_huge_pages,
                draft_model=resolve_model(draft) if draft else None,
            ),
            hf_config,
            eos,
        )
        logger.info(
            "engine ready: %s on %s, %d KV tokens, max_model_len %d, %s attention (%s prefill), "
            "%s linear, %s element-wise", folder.name, device, runner.num_blocks * args.block_size,
            runner.max_model_len, runner.attention_backend, runner.prefill_attention,
            runner.linear_backend, runner.model.elementwise,
        )
        return cls(
            args, tokenizer, runner, runner.max_model_len, runner.num_blocks, eos,
            hf_config.vocab_size,
        )

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
            self._require_loras()
        if params.n > self.scheduler.config.max_num_seqs:
            raise InvalidRequestError(
                f"n={params.n} exceeds max_num_seqs={self.scheduler.config.max_num_seqs}"
            )
        check_request_tokens(params.speculative_tokens, self.scheduler.config.speculative)
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_length(len(token_ids), params)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                f"(size {self.vocab_size})", param="logit_bias")
        # compiled here, so a bad schema is refused before anything is queued
        grammar = self.grammars().compile(params.structured) if params.structured else None
        if params.max_tokens != max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        return PreparedRequest(text, token_ids, params, cache_salt, lora, grammar)

    def grammars(self) -> Any:
        """The structured-outputs backend (a `StructuredBackend`), built on first use: it
        reads the whole vocabulary once (under a second) and imports llguidance."""
        with self._grammars_lock:
            if self._grammars is None:
                from workers.runner.structured_backend import StructuredBackend

                self._grammars = StructuredBackend(self.tokenizer, self.vocab_size,
                                                   self.eos_token_ids)
            return self._grammars

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
        loras = self._require_loras() if prepared.lora is not None else None
        entry = loras.get(prepared.lora) if loras and prepared.lora else None
        if params.structured is not None and prepared.grammar is None:
            raise InvalidRequestError("a structured request must come from prepare_request")
        request = _Request(request_id, prepared.prompt, token_ids, params, metrics,
                           prepared.cache_salt, entry.lora_id if entry else None,
                           prepared.grammar, progress=prepared.progress,
                           tenant=prepared.tenant, weight=prepared.weight)
        seq = self._new_sequence(request, list(token_ids), 0, priority, next(self._arrivals))
        seq.pending_forks = params.n - 1
        self._requests[request_id] = request
        self._num_enqueued += 1
        if loras is not None and entry is not None:
            loras.acquire(entry)
            if entry.adapter is None:  # evicted to disk: wait for the read, off the queue
                loras.park(entry, seq)
                return
        self.scheduler.add(seq)

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
        self._release_lora(request)
        request.metrics.finished_time = time.monotonic()
        return self._output(request)

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

    # ---- adapters -------------------------------------------------------------------------

    def add_lora(self, name: str, path: str, *, adapter: Any = None, pinned: bool = False) -> None:
        """Register an adapter (idempotent). Pass `adapter` when it was read off this thread."""
        loras = self._require_loras()
        if adapter is None:
            adapter = self.runner.read_adapter(name, path)
        loras.add(name, path, pinned=pinned)
        self.put_lora(name, adapter)

    def remove_lora(self, name: str, *, drain: bool = False) -> bool:
        """Forget an adapter; True once gone. While requests use it: refuse (AdapterBusyError)
        or, with `drain`, refuse new requests for it and return False (ask again later)."""
        loras = self._require_loras()
        entry = loras.entries.get(name)
        if entry is not None and entry.num_requests and drain:
            entry.draining = True
            return False
        loras.remove(name)
        return True

    def cancel_unload(self, name: str) -> None:
        entry = self._require_loras().entries.get(name)
        if entry is not None:
            entry.draining = False

    def list_loras(self) -> list[AdapterStatus]:
        return self._require_loras().status() if self.loras else []

    def pending_lora_reads(self) -> list[tuple[str, str]]:
        """Adapters that parked requests wait for: read them (off the step loop), then
        `put_lora` or `fail_lora`."""
        return self.loras.pending_reads() if self.loras else []

    def put_lora(self, name: str, adapter: Any) -> None:
        loras = self._require_loras()
        entry = loras.entries.get(name)
        if entry is None:
            return  # removed while it was being read
        for seq in loras.put_cpu(entry, adapter):
            if not seq.is_finished:
                self.scheduler.add(seq)

    def fail_lora(self, name: str) -> list[str]:
        """The adapter could not be read back: abort its parked requests; their ids."""
        loras = self._require_loras()
        entry = loras.entries.get(name)
        if entry is None:
            return []
        ids = [seq.request_id for seq in loras.unpark(entry)]
        for request_id in ids:
            self.abort_request(request_id)
        return ids

    def _release_lora(self, request: _Request) -> None:
        if self.loras is None or request.lora_id is None:
            return
        entry = self.loras.by_id.get(request.lora_id)
        if entry is not None:
            self.loras.unpark(entry, request.request_id)
        self.loras.release(request.lora_id)
        request.lora_id = None

    def _require_loras(self) -> LoRAManager:
        if self.loras is None:
            raise InvalidRequestError("this engine does not serve LoRA adapters (enable_lora)",
                                      param="model")
        return self.loras

    def _read_parked_adapters(self) -> None:
        for name, path in self.pending_lora_reads():
            try:
                adapter = self.runner.read_adapter(name, path)
            except (OSError, ValueError):
                logger.exception("adapter %s could not be read back from %s", name, path)
                self.fail_lora(name)
                continue
            self.put_lora(name, adapter)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> dict[str, float]:
        """Load figures for routing and autoscaling."""
        stats = {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "kv_cache_usage": self.block_manager.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_rate": self.block_manager.num_hit_tokens
            / max(self.block_manager.num_queried_tokens, 1),
            "prefix_cache_hit_tokens": self.block_manager.num_hit_tokens,
            "prefix_cache_queried_tokens": self.block_manager.num_queried_tokens,
            "num_interjections": self.num_interjections,
            "num_grammar_errors": self.num_grammar_errors,
            "kv_capacity_tokens": self.block_manager.num_blocks * self.block_manager.block_size,
        }
        if self.block_manager.enable_caching:
            hot = self.block_manager.hot_blocks(self.args.prefix_hot_window_s)
            stats["kv_hot_tokens"] = hot * self.block_manager.block_size
        if self.scheduler.config.speculative is not None:
            stats.update(self.spec_stats.figures())
        if self.loras is not None:
            stats.update(
                num_loras=len(self.loras.entries),
                num_loras_on_device=len(self.loras.slot_of),
                lora_device_loads=self.loras.num_device_loads,
                lora_device_evictions=self.loras.num_device_evictions,
                lora_cpu_evictions=self.loras.num_cpu_evictions,
            )
        return stats

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
        (`_interject`) and answered before this step ends."""
        if self.read_adapters_in_step:
            self._read_parked_adapters()
        sched = self.scheduler.schedule()
        self._note_scheduled(sched)
        self._interjected_s = 0.0
        started = time.perf_counter()
        results = self.runner.execute(sched, self._interjection_hook(sched))
        elapsed = time.perf_counter() - started - self._interjected_s
        self.scheduler.observe_step(sched, elapsed)
        return self._update(sched, results)

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        if self.loras is not None:
            self._assign_lora_slots(sched)
        now = time.monotonic()
        for chunk in sched.chunks:
            request = self._request_of(chunk.seq_id)
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            _note_progress(request, self._seqs[chunk.seq_id])
        for seq_id in sched.preempted_seq_ids:
            self._request_of(seq_id).metrics.num_preemptions += 1

    def _interjection_hook(self, sched: SchedulerOutput) -> Callable[[], None] | None:
        """The step's `between_layers`: at its first layer boundary, and at each later one
        where requests arrived, a step for waiting requests may run (`_interject`)."""
        config = self.scheduler.config
        if (self.arrivals is None or config.interject_tokens <= 0 or config.policy != "fair"
                or not sched.chunks):
            return None
        first = [True]

        def between_layers() -> None:
            enqueued = self._num_enqueued
            assert self.arrivals is not None
            self.arrivals.admit(self)
            if first[0] or self._num_enqueued != enqueued:
                first[0] = False
                self._interject(sched)

        return between_layers

    def _interject(self, in_flight: SchedulerOutput) -> None:
        """Between two layers of the step in flight: run a step of the waiting requests that
        may interject (`Scheduler.schedule_interjection`), publishing its outputs at once.
        The step in flight then resumes where it stopped; its timing leaves this one out."""
        assert self.arrivals is not None
        started = time.perf_counter()
        sched = self.scheduler.schedule_interjection(in_flight)
        if sched.chunks:
            self._note_scheduled(sched)
            run_started = time.perf_counter()
            results = self.runner.execute(sched)
            self.scheduler.observe_step(sched, time.perf_counter() - run_started)
            self.num_interjections += 1
            self.arrivals.publish(self._update(sched, results))
        self._interjected_s += time.perf_counter() - started

    def _assign_lora_slots(self, sched: SchedulerOutput) -> None:
        assert self.loras is not None
        ids = {c.lora_id for c in sched.chunks if c.lora_id is not None}
        if not ids:
            return
        sched.lora_loads = self.loras.assign_slots(ids, self.scheduler.active_loras())
        for chunk in sched.chunks:
            if chunk.lora_id is not None:
                chunk.lora_slot = self.loras.slot_of[chunk.lora_id]

    def _update(self, sched: SchedulerOutput, results: dict[int, Any]) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for seq_id, result in results.items():
            seq = self._seqs[seq_id]
            request = self._requests[seq.request_id]
            touched[request.request_id] = request
            if result.num_drafts:
                self._accept_verified(request, seq, result, now)
                continue
            tokens = result.token_ids
            logprobs = result.logprobs or [None] * len(tokens)
            children = self._fork(request, seq, tokens[1:]) if seq.pending_forks else []
            self._accept(request, seq, tokens[0], logprobs[0], now)
            for child, token, logprob in zip(children, tokens[1:], logprobs[1:], strict=True):
                self._accept(request, child, token, logprob, now)
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                self._release_lora(request)
                del self._requests[request.request_id]
                for sample in request.samples:
                    self._seqs.pop(sample.seq.seq_id, None)
            outputs.append(self._output(request))
        return outputs

    def _fork(self, request: _Request, parent: Sequence, first_tokens: list[int]) -> list[Sequence]:
        parent.pending_forks = 0
        children = []
        for index in range(1, len(first_tokens) + 1):
            child = self._new_sequence(
                request, list(parent.token_ids), index, parent.priority, parent.arrival_order
            )
            self.scheduler.fork(parent, child)
            children.append(child)
        return children

    def _accept_verified(self, request: _Request, seq: Sequence, result: Any,
                         now: float) -> None:
        """A speculating step's tokens: the proposals the model kept, then one of its own.
        The KV of the last token and of each kept proposal is valid; the rest is rolled back
        (`num_computed_tokens`, and the blocks past the tokens go back to the pool)."""
        tokens = result.token_ids
        self.spec_stats.record(result.num_drafts, len(tokens) - 1)
        back_off(seq, len(tokens) - 1)
        logprobs = result.logprobs or [None] * len(tokens)
        seq.num_computed_tokens = seq.num_tokens  # through the step's first position
        for j, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            if j:
                seq.num_computed_tokens += 1  # the kept proposal before this token
                if seq.sample_index == 0:
                    request.metrics.num_token_steps += 1  # a position of its own, for TPOT
            self._accept(request, seq, token, logprob, now)
            if seq.is_finished:
                return
        self.block_manager.trim(seq)

    def _accept(
        self, request: _Request, seq: Sequence, token: int, logprob: TokenLogprob | None,
        now: float,
    ) -> None:
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
        params = seq.sampling_params
        grammar_done = grammar_broken = False
        if seq.grammar is not None:
            grammar_done, grammar_broken = self._advance_grammar(seq, token)
        if grammar_broken:
            if params.detokenize:
                sample.detokenizer.append(token)  # the text shows what token_ids hold
            reason = FinishReason.ERROR
        elif params.detokenize and sample.detokenizer.append(token):
            sample.stop_reason = sample.detokenizer.stop_reason
            reason = FinishReason.STOP
        elif grammar_done or (not params.ignore_eos and token in self.eos_token_ids):
            reason = FinishReason.STOP
        elif token in params.stop_token_ids:
            reason, sample.stop_reason = FinishReason.STOP, token
        elif (
            seq.num_output_tokens >= (params.max_tokens or 0)
            or seq.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        else:
            return
        if params.detokenize:
            sample.detokenizer.flush()
        seq.finish_reason = reason
        self.scheduler.finish(seq)

    def _advance_grammar(self, seq: Sequence, token: int) -> tuple[bool, bool]:
        """Feed a kept token to the sample's matcher: (ended, broken). Ended: nothing more can
        follow, or a stop token came where it was allowed, whatever ignore_eos says.

        Broken: the matcher refused the token its own mask allowed (llguidance hit one of its
        limits, or a bug). That sample's output cannot be trusted, and ending it as "stop"
        would pass a cut document off as complete (or "length" as merely long), so it ends
        with `FinishReason.ERROR`: logged here at error level with the request id, counted
        in `num_grammar_errors`, and failed to the client (a 500, code `grammar_error`)."""
        assert seq.grammar is not None
        if seq.grammar.accept_token(token):
            return seq.grammar.is_terminated(), False
        self.num_grammar_errors += 1
        logger.error("request %s: sample %d: token %d is outside its grammar (%s); the sample "
                     "fails with a grammar_error", seq.request_id, seq.sample_index, token,
                     seq.grammar.error() or "refused")
        return False, True

    # ---- helpers --------------------------------------------------------------------------

    def _new_sequence(
        self, request: _Request, token_ids: list[int], index: int, priority: int, arrival: int
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
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=list(params.stop or []),
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        request.samples.append(
            _Sample(seq, detokenizer, [] if params.logprobs is not None else None)
        )
        self._seqs[seq.seq_id] = seq
        return seq

    def _request_of(self, seq_id: int) -> _Request:
        return self._requests[self._seqs[seq_id].request_id]

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
            if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty")
        return text, token_ids

    def _check_length(self, prompt_len: int, params: SamplingParams) -> int:
        """The effective max_tokens; refuse what can never fit the context window."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; "
                f"the prompt has {prompt_len}", param="prompt", code="context_length_exceeded"
            )
        if params.max_tokens is None:
            return limit - prompt_len
        if prompt_len + params.max_tokens > limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{prompt_len + params.max_tokens} ({prompt_len} in the prompt, "
                f"{params.max_tokens} to generate)", param="max_tokens",
                code="context_length_exceeded",
            )
        return params.max_tokens

    def _output(self, request: _Request) -> RequestOutput:
        delta = request.params.output_kind == "delta"
        outputs = [self._sample_output(i, sample, delta)
                   for i, sample in enumerate(request.samples)]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished or request.request_id not in self._requests,
            metrics=request.metrics,
            num_cached_tokens=request.samples[0].seq.num_cached_tokens or 0,
        )

    @staticmethod
    def _sample_output(index: int, sample: _Sample, delta: bool) -> CompletionOutput:
        seq = sample.seq
        text = sample.detokenizer.text
        tokens = seq.token_ids
        logprobs = sample.logprobs
        if delta:  # only what is new: O(new) per step, not a copy of everything so far
            start = seq.num_prompt_tokens + sample.sent_tokens
            out_text = text[sample.sent_text:]
            out_tokens = tokens[start:]
            out_logprobs = None if logprobs is None else logprobs[sample.sent_logprobs:]
            sample.sent_text = max(sample.sent_text, len(text))
            sample.sent_tokens = len(tokens) - seq.num_prompt_tokens
            sample.sent_logprobs = 0 if logprobs is None else len(logprobs)
        else:
            out_text, out_tokens = text, seq.output_token_ids
            out_logprobs = None if logprobs is None else list(logprobs)
        return CompletionOutput(
            index=index, text=out_text, token_ids=out_tokens,
            finish_reason=str(seq.finish_reason) if seq.finish_reason else None,
            stop_reason=sample.stop_reason, logprobs=out_logprobs)


def _interject_tokens(args: EngineArgs, runner: Any) -> int:
    """`interject_tokens`, with None resolved: on for CPU steps, which are long (a paused
    step costs nothing there); off on CUDA, where a step is short and the pause would
    synchronise the device mid-step."""
    if args.interject_tokens is not None:
        return args.interject_tokens
    device = getattr(runner, "device", None)
    return DEFAULT_INTERJECT_TOKENS if device is None or device.type == "cpu" else 0


def _note_progress(request: _Request, seq: Sequence) -> None:
    """The prompt tokens computed so far (never fewer than before: a preempted request's
    recompute is not billed twice)."""
    progress = request.progress
    computed = min(seq.num_computed_tokens, len(request.prompt_token_ids))
    progress.num_computed_tokens = max(progress.num_computed_tokens, computed)
    progress.num_cached_tokens = max(progress.num_cached_tokens, seq.num_cached_tokens or 0)


def _eos_token_ids(hf_config: Any, tokenizer: Any) -> list[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({i for i in ids if i is not None})
