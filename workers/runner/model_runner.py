"""Runs one scheduled step: build the flattened batch, run the model, sample.

Input is the scheduler's plain `SchedulerOutput`; output is one `SampleResult` per sequence
that samples this step. Single-token chunks (decodes, and one-token prefill tails) go first
so attention serves them with one call; prefill chunks follow. A speculating chunk (its last
token plus proposed ones) is split into single-token rows, one per position: each attends to
the pool up to its own position (its K/V are written before attention reads), so the decode
kernels score every proposal in place, and the sampler verifies them (`rejection.py`).
Within each kind, rows are ordered by LoRA slot so that rows of one adapter form one
contiguous segment. Rows under a grammar (structured outputs) get a token mask from their
matcher, filled on the CPU while the device computes the logits.

With decode graphs (`cuda_graphs`, `enable_decode_graphs`), a step whose rows are all
single-token sampling rows of the base model, without proposals, and no more than the largest
bucket replays a captured graph instead (`cuda_graphs.py`); every other step runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.engine.scheduler import ScheduledChunk, SchedulerOutput
from workers.lora.adapter import LoRAAdapter, ModuleShape, load_adapter
from workers.runner import cpu_amx, host_heap, kv_cache, token_mask
from workers.runner.attention import (
    AttentionMetadata,
    GatherWorkspace,
    build_metadata,
    fixed_decode_metadata,
    pool_window,
    slot_rows,
)
from workers.runner.attention_backend import pick_attention_backend, pick_prefill_attention
from workers.runner.cpu_fused import pick_elementwise
from workers.runner.cuda_graphs import DecodeGraphs, Graph, StepViews, cuda_graph_factory
from workers.runner.draft import DraftProposer
from workers.runner.kv_quant import check_kv_cache_dtype
from workers.runner.linear import (
    PACKED_BACKENDS,
    TILE_KERNELS,
    Linear,
    linear_kernel,
    pick_linear_backend,
)
from workers.runner.lora import NO_ADAPTER, LoRABatch, LoRASlots
from workers.runner.models import build_model, check_model_folder
from workers.runner.models.layers import MLP, DecoderModel
from workers.runner.models.weights import head_differs_from_embedding, load_weights
from workers.runner.quantization import (
    check_int8_compute,
    check_quantizable,
    check_quantization,
    pick_int8_compute,
    quantize,
)
from workers.runner.rejection import SpecRow, verify
from workers.runner.sampler import SampleResult, SamplingRow, sample
from workers.runner.token_mask import TokenMask

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    """A run of query tokens of one chunk in the flattened batch."""

    chunk: ScheduledChunk
    start_pos: int
    token_ids: list[int]


@dataclass
class RunnerConfig:
    model_path: Path
    device: torch.device
    dtype: torch.dtype
    block_size: int
    kv_cache_memory: int | None
    kv_cache_fraction: float | None
    max_model_len: int | None
    max_loras: int = 0
    max_lora_rank: int = 16
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    prefill_attention: str = "auto"  # auto | amx | vec | flash | masked | causal (prompt chunks)
    elementwise: str = "auto"  # auto | torch | cpu (workers/runner/cpu_fused.py)
    draft_model: Path | None = None  # speculative decoding's draft (same vocabulary)
    quantization: str = "none"  # none | int8 (weights; workers/runner/quantization.py)
    int8_compute: str = "auto"  # auto | model | bfloat16: the dtype int8 weights multiply in
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 (workers/runner/kv_quant.py)
    kv_huge_pages: bool = True  # the CPU pool in 2 MB pages (workers/runner/huge_pages.py)
    keep_host_heap: bool = True  # freed CPU memory stays mapped (workers/runner/host_heap.py)
    # decode batch sizes captured as CUDA graphs on CUDA (`cuda_graphs.capture_sizes`); ()
    # captures none. Ignored on CPU.
    decode_graph_sizes: tuple[int, ...] = ()


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float64": torch.float64}[dtype]


class ModelRunner:
    def __init__(
        self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_blocks: int, block_size: int, max_model_len: int, eos_token_ids: list[int],
        *, lora_slots: LoRASlots | None = None, max_lora_rank: int = 16,
        attention_backend: str = "torch", linear_backend: str = "torch",
        prefill_attention: str = "masked", draft: DraftProposer | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config
        self.num_kv_heads = config.num_key_value_heads
        self.group = config.num_attention_heads // config.num_key_value_heads
        self._generators: dict[int, torch.Generator] = {}
        self.max_lora_rank = max_lora_rank
        self.lora_slots = lora_slots
        self.attention_backend = attention_backend
        self.linear_backend = linear_backend  # what the model's projections already use
        self.prefill_attention = prefill_attention  # read per step: may be switched between
        self.workspace = GatherWorkspace()
        self.draft = draft
        self.graphs: DecodeGraphs | None = None  # `enable_decode_graphs`

    @classmethod
    def load(cls, config: RunnerConfig, hf_config: Any, eos_token_ids: list[int]) -> ModelRunner:
        """Build the model, load weights and allocate the KV pool from the memory budget."""
        if config.keep_host_heap and config.device.type == "cpu":
            host_heap.keep_freed_memory()
        max_positions = hf_config.max_position_embeddings
        if config.max_model_len:
            max_positions = max(max_positions, config.max_model_len)
        model, linear_backend = _build_model(config.model_path, hf_config, config, max_positions)
        served_len = model.arch.max_model_len  # the longest this family serves exactly
        if served_len is not None and config.max_model_len and config.max_model_len > served_len:
            raise ValueError(f"{model.arch.family}: max_model_len {config.max_model_len} is "
                             f"past the {served_len} positions served exactly")
        head_dim = model.layers[0].self_attn.head_dim
        kv_dtype = check_kv_cache_dtype(config.kv_cache_dtype, head_dim)
        backend = pick_attention_backend(
            config.attention_backend, config.device, config.block_size, head_dim,
            group=hf_config.num_attention_heads // hf_config.num_key_value_heads,
            dtype=config.dtype, kv_cache_dtype=kv_dtype)
        prefill = pick_prefill_attention(config.prefill_attention, config.device,
                                         dtype=config.dtype, head_dim=head_dim)
        spec = kv_cache.KVCacheSpec(
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            block_size=config.block_size,
            dtype=config.dtype,
            kv_cache_dtype=kv_dtype,
        )
        lora_slots = None
        if config.max_loras:  # before the KV budget, which may be a share of what is free
            lora_slots = LoRASlots(
                num_slots=config.max_loras, max_rank=config.max_lora_rank,
                num_layers=hf_config.num_hidden_layers, shapes=projection_shapes(model),
                dtype=config.dtype, device=config.device, packed=model.lora_packing())
        budget = kv_cache.budget_bytes(
            config.device, config.kv_cache_memory, config.kv_cache_fraction
        )
        draft = _DraftParts.load(config, hf_config, max_positions) if config.draft_model else None
        per_block = spec.bytes_per_block + (draft.spec.bytes_per_block if draft else 0)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block")
        caches = kv_cache.allocate(spec, num_blocks, config.device,
                                   huge_pages=config.kv_huge_pages)
        proposer = draft.proposer(num_blocks, config, prefill=prefill) if draft else None
        max_model_len = min(
            config.max_model_len or served_len or hf_config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        runner = cls(model, caches, num_blocks, config.block_size, max_model_len,
                     eos_token_ids, lora_slots=lora_slots, max_lora_rank=config.max_lora_rank,
                     attention_backend=backend, linear_backend=linear_backend,
                     prefill_attention=prefill, draft=proposer)
        if config.decode_graph_sizes and config.device.type == "cuda":
            runner.enable_decode_graphs(config.decode_graph_sizes)
        return runner

    def decode_graph_refusal(self) -> str | None:
        """Why this runner's decode steps cannot be captured, or None."""
        if self.attention_backend not in ("triton", "cpu"):
            return (f"decode attention is {self.attention_backend!r}: a graph needs the "
                    "in-place kernel, which takes fixed-size tables")
        if any(not isinstance(layer.mlp, MLP) for layer in self.model.layers):
            return ("mixture-of-experts routing counts tokens per expert (bincount), which "
                    "waits for the device")
        return None

    def enable_decode_graphs(self, sizes: Sequence[int],
                             new_graph: Callable[[], Graph] | None = None) -> bool:
        """Capture decode graphs of these batch sizes (None `new_graph`: CUDA graphs sharing
        one memory pool; tests on CPU pass a double). The pool's last block becomes the
        padding rows' null block: call this before an engine is built on the runner, whose
        block manager takes `num_blocks`. False, with the reason logged, where the model or
        its kernels cannot be captured (`decode_graph_refusal`)."""
        reason = self.decode_graph_refusal()
        if reason is not None or not sizes:
            logger.info("decode steps run eagerly: %s", reason or "no batch size to capture")
            return False
        if self.num_blocks < 2:
            raise ValueError("decode graphs need a KV pool of at least 2 blocks (one is the "
                             "padding rows' null block)")
        eager = (self.num_blocks, self.max_model_len)
        self.num_blocks -= 1
        self.max_model_len = min(self.max_model_len, self.num_blocks * self.block_size)
        self.graphs = DecodeGraphs(
            self._graph_forward, sizes, max_blocks=-(-self.max_model_len // self.block_size),
            block_size=self.block_size, null_block=self.num_blocks, device=self.device,
            new_graph=new_graph or cuda_graph_factory())
        try:
            self.graphs.capture()
        except RuntimeError as exc:
            # A capture the device refuses (a kernel that syncs, an allocator limit) costs
            # speed, not service: the engine starts eager, with the reason in the log.
            logger.warning("decode graphs could not be captured, decode steps run eagerly: %s",
                           exc)
            self.graphs = None
            self.num_blocks, self.max_model_len = eager
            return False
        logger.info("decode graphs captured for batch sizes %s", list(self.graphs.sizes))
        return True

    def _graph_forward(self, views: StepViews) -> torch.Tensor:
        """A decode step over a bucket's buffers, as graphs capture it: logits of every row."""
        meta = fixed_decode_metadata(
            self.attention_backend, slot_rows(views.slots, self.block_size, self.num_kv_heads),
            views.block_tables, views.seq_lens, self.block_size, self.num_kv_heads,
            self.group, self.device, self.dtype)
        hidden = self.model(views.token_ids, views.positions, self.kv_caches, meta,
                            self.block_size)
        return self.model.compute_logits(hidden)

    def _replayable(self, rows: list[_Row]) -> bool:
        """Whether a captured graph serves these rows: single tokens that sample, of the base
        model, without proposals, and no more rows than the largest bucket. LoRA rows,
        speculation and prefill chunks run eagerly."""
        graphs = self.graphs
        return graphs is not None and 0 < len(rows) <= graphs.max_rows and all(
            len(r.token_ids) == 1 and r.chunk.num_samples and not r.chunk.draft_token_ids
            and r.chunk.lora_slot == NO_ADAPTER for r in rows)

    @property
    def kv_window(self) -> int | None:
        """The window by which the block manager gives a sequence's old blocks back
        (`BlockManager(window=)`): where every layer attends within one (`pool_window`);
        None with a draft model, which reads the same block tables."""
        if self.draft is not None:
            return None
        return pool_window(getattr(self.model, "windows", ()))

    def read_adapter(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and validate a peft adapter for this model (disk I/O: call off the step loop)."""
        return load_adapter(path, name=name, max_rank=self.max_lora_rank,
                            num_layers=self.model.config.num_hidden_layers,
                            shapes=projection_shapes(self.model), dtype=self.dtype,
                            family=self.model.arch.family)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                between_layers: Callable[[], None] | None = None) -> dict[int, SampleResult]:
        """Run the step; `between_layers` is handed to the model (`DecoderModel.forward`)."""
        for seq_id in sched.finished_seq_ids:
            self._generators.pop(seq_id, None)
        if self.draft is not None:
            self.draft.forget(sched.finished_seq_ids + sched.preempted_seq_ids)
        if sched.blocks_to_copy:
            self._copy_blocks(sched.blocks_to_copy)
        for slot, adapter in sched.lora_loads:
            assert self.lora_slots is not None, "LoRA is not enabled on this runner"
            self.lora_slots.load(slot, adapter)
        if not sched.chunks:
            return {}
        draft_probs = self._draft_proposals(sched.chunks)
        # decodes first, by adapter, then shortest context first (for grouping); then prefill
        # chunks, by adapter
        rows = sorted(_rows(sched.chunks), key=lambda r: (
            len(r.token_ids) != 1, r.chunk.lora_slot,
            r.start_pos if len(r.token_ids) == 1 else 0))
        if self._replayable(rows):  # one launch: no pause between its layers
            assert self.graphs is not None
            plain, spec = [r.chunk for r in rows], []
            logits = self.graphs.run([(r.token_ids[0], r.start_pos, r.chunk.block_table)
                                      for r in rows])
        else:
            plain = [c for c in sched.chunks if c.num_samples and not c.draft_token_ids]
            spec = [c for c in sched.chunks if c.num_samples and c.draft_token_ids]
            logits = self._eager_logits(rows, plain, spec, between_layers)
            if logits is None:
                return {}
        results: dict[int, SampleResult] = {}
        if plain:
            mask = self._token_mask(plain)  # CPU work, overlapping the device's (on CUDA)
            plain_rows = [self._sampling_row(c) for c in plain]
            sampled = sample(logits[: len(plain)], plain_rows, self.eos_token_ids, mask)
            results.update((c.seq_id, r) for c, r in zip(plain, sampled, strict=True))
        if spec:
            spec_rows = [SpecRow(self._sampling_row(c), c.draft_token_ids,
                                 draft_probs.get(c.seq_id)) for c in spec]
            verified = verify(logits[len(plain):], spec_rows, self.eos_token_ids,
                              self._spec_mask(spec))
            results.update((c.seq_id, r) for c, r in zip(spec, verified, strict=True))
            if self.draft is not None:
                for c in spec:
                    self.draft.settle(c.seq_id, c.start_pos, len(results[c.seq_id].token_ids) - 1)
        return results

    def _eager_logits(self, rows: list[_Row], plain: list[ScheduledChunk],
                      spec: list[ScheduledChunk], between_layers: Callable[[], None] | None
                      ) -> torch.Tensor | None:
        """The model over the flattened rows; the logits of `plain`'s last tokens, then of
        every position of `spec`'s chunks (None where nothing samples)."""
        input_ids, positions, meta, ends = self._prepare(rows)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.block_size,
                            self._lora_batch(rows), between_layers)
        if not plain and not spec:
            return None
        picks = [ends[(c.seq_id, c.start_pos + c.num_tokens - 1)] for c in plain]
        for c in spec:
            picks.extend(ends[(c.seq_id, c.start_pos + i)] for i in range(c.num_tokens))
        index = torch.tensor(picks).to(hidden.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index))

    def _draft_proposals(self, chunks: list[ScheduledChunk]) -> dict[int, torch.Tensor | None]:
        """Fill the draft slots of this step's chunks from the draft model; the draft's
        distributions of sampling rows, by sequence."""
        pending = [c for c in chunks if c.num_draft_slots and not c.draft_token_ids]
        if not pending:
            return {}
        assert self.draft is not None, "draft slots need a runner with a draft model"
        proposals = self.draft.propose(pending, [self._sampling_row(c) for c in pending])
        for chunk, proposal in zip(pending, proposals, strict=True):
            chunk.draft_token_ids = proposal.tokens
            chunk.token_ids = chunk.token_ids + proposal.tokens
        return {c.seq_id: p.probs for c, p in zip(pending, proposals, strict=True)}

    def _prepare(
        self, rows: list[_Row]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, dict[tuple[int, int], int]]:
        """The flat batch, and where each row's last token landed: (seq_id, position) ->
        flat index."""
        token_ids: list[int] = []
        positions: list[int] = []
        ends: dict[tuple[int, int], int] = {}
        for row in rows:
            token_ids.extend(row.token_ids)
            positions.extend(range(row.start_pos, row.start_pos + len(row.token_ids)))
            ends[(row.chunk.seq_id, row.start_pos + len(row.token_ids) - 1)] = len(token_ids) - 1
        meta = build_metadata(
            [(r.start_pos, len(r.token_ids), r.chunk.block_table) for r in rows],
            self.block_size, self.num_kv_heads, self.group, self.device, self.dtype,
            decode_kernel=None if self.attention_backend == "torch" else self.attention_backend,
            prefill_kernel=self.prefill_attention, workspace=self.workspace,
        )
        device = self.device
        return (
            torch.tensor(token_ids, dtype=torch.long).to(device, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
            meta,
            ends,
        )

    def _lora_batch(self, rows: list[_Row]) -> LoRABatch | None:
        if self.lora_slots is None or all(r.chunk.lora_slot == NO_ADAPTER for r in rows):
            return None
        return LoRABatch.build(
            self.lora_slots, [(r.chunk.lora_slot, len(r.token_ids)) for r in rows], self.device)

    def _token_mask(self, chunks: list[ScheduledChunk]) -> TokenMask | None:
        """Allowed next tokens of the rows under a grammar; the others pay nothing."""
        constrained = [i for i, c in enumerate(chunks) if c.grammar is not None]
        if not constrained:
            return None
        matchers = [chunks[i].grammar for i in constrained]
        return token_mask.fill(matchers, constrained, self.model.config.vocab_size, self.device)

    def _spec_mask(self, chunks: list[ScheduledChunk]) -> TokenMask | None:
        """Allowed tokens at every position of the speculating rows under a grammar."""
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        offset = 0
        vocab = self.model.config.vocab_size
        for chunk in chunks:
            if chunk.grammar is not None:
                masks.append(token_mask.fill_ahead(chunk.grammar, chunk.draft_token_ids, vocab))
                rows.extend(range(offset, offset + chunk.num_tokens))
            offset += chunk.num_tokens
        if not masks:
            return None
        return TokenMask(rows, torch.cat(masks).to(self.device, non_blocking=True))

    def _sampling_row(self, chunk: ScheduledChunk) -> SamplingRow:
        generator = None
        if chunk.seed is not None and not chunk.sampling_params.greedy:
            generator = self._generators.get(chunk.seq_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(chunk.seed)
                self._generators[chunk.seq_id] = generator
        return SamplingRow(
            params=chunk.sampling_params,
            num_samples=chunk.num_samples,
            generator=generator,
            prompt_token_ids=chunk.prompt_token_ids,
            output_token_ids=chunk.output_token_ids,
            num_output_tokens=chunk.num_output_tokens,
        )

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        kv_cache.copy_blocks(self.kv_caches, src, dst)
        if self.draft is not None:  # its pool shares the block ids
            kv_cache.copy_blocks(self.draft.kv_caches, src, dst)


def _build_model(path: Path, hf_config: Any, config: RunnerConfig, max_positions: int
                 ) -> tuple[DecoderModel, str]:
    """The model with its weights, projection kernel and quantization; and that kernel. The
    family comes from the registry (`workers/runner/models`), which refuses an architecture it
    does not serve before anything is read."""
    check_model_folder(path)
    if getattr(hf_config, "tie_word_embeddings", False) and head_differs_from_embedding(path):
        logger.warning("%s: the config ties the LM head to the embedding but the checkpoint "
                       "keeps a different lm_head.weight; serving them untied, as "
                       "transformers does", path)
        hf_config.tie_word_embeddings = False
    with torch.device(config.device):
        model = build_model(hf_config, max_positions, max_model_len=(
            config.max_model_len or hf_config.max_position_embeddings)).to(config.dtype)
    model.rotary.float()
    model.requires_grad_(False)
    check_quantizable(model, config.quantization)  # a family's refusal, before any weight
    load_weights(model, path)
    model.eval()
    linear_backend = pick_linear_backend(config.linear_backend, config.device, config.dtype,
                                         quantized=config.quantization != "none")
    if linear_backend in TILE_KERNELS and config.linear_backend == "auto":
        copy = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                   if isinstance(m, Linear))
        if model.tie_word_embeddings:  # the head's copy reads the embedding
            copy += model.embed_tokens.weight.nbytes
        if not cpu_amx.copy_fits(copy):
            logger.info("not keeping a tile copy of %d MB of weights (over a quarter of the "
                        "memory available); linear backend onednn_packed", copy >> 20)
            linear_backend = "onednn_packed"
    model.use_linear_kernel(linear_kernel(linear_backend))
    check_int8_compute(config.int8_compute)  # probed only where there are int8 weights
    if check_quantization(config.quantization) != "none":  # before packing (it refuses int8)
        compute = pick_int8_compute(config.int8_compute, config.device, config.dtype)
        quantize(model, config.quantization, linear_backend, compute)
    if linear_backend in PACKED_BACKENDS:
        model.pack_linears(tiles=TILE_KERNELS.get(linear_backend),
                           upcast=linear_backend == "onednn_upcast")
    model.use_elementwise(pick_elementwise(config.elementwise, config.device, config.dtype))
    return model, linear_backend


@dataclass
class _DraftParts:
    """The draft model and its KV layout, before the pool (sized with the target's) exists."""

    model: DecoderModel
    spec: kv_cache.KVCacheSpec

    @classmethod
    def load(cls, config: RunnerConfig, target_config: Any, max_positions: int) -> _DraftParts:
        from transformers import AutoConfig

        assert config.draft_model is not None
        hf_config = AutoConfig.from_pretrained(config.draft_model)
        if hf_config.vocab_size != target_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({hf_config.vocab_size}) differs "
                             f"from the model's ({target_config.vocab_size})")
        model, _ = _build_model(Path(config.draft_model), hf_config, config, max_positions)
        spec = kv_cache.KVCacheSpec(
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=model.layers[0].self_attn.head_dim,
            block_size=config.block_size,
            dtype=config.dtype,
        )
        return cls(model, spec)

    def proposer(self, num_blocks: int, config: RunnerConfig, *, prefill: str
                 ) -> DraftProposer:
        hf_config = self.model.config
        backend = pick_attention_backend(
            config.attention_backend, config.device, config.block_size, self.spec.head_dim,
            group=hf_config.num_attention_heads // hf_config.num_key_value_heads,
            dtype=config.dtype)
        try:
            prefill = pick_prefill_attention(prefill, config.device, dtype=config.dtype,
                                             head_dim=self.spec.head_dim)
        except ValueError:  # the target's prefill kernel does not take the draft's heads
            prefill = pick_prefill_attention("auto", config.device, dtype=config.dtype,
                                             head_dim=self.spec.head_dim)
        caches = kv_cache.allocate(self.spec, num_blocks, config.device,
                                   huge_pages=config.kv_huge_pages)
        return DraftProposer(self.model, caches, config.block_size, backend, prefill,
                             dtype=config.dtype)


def _rows(chunks: list[ScheduledChunk]) -> list[_Row]:
    """One row per chunk, or one per position of a speculating chunk."""
    rows = []
    for chunk in chunks:
        if chunk.draft_token_ids:
            rows.extend(_Row(chunk, chunk.start_pos + i, [token])
                        for i, token in enumerate(chunk.token_ids))
        else:
            rows.append(_Row(chunk, chunk.start_pos, chunk.token_ids))
    return rows


def projection_shapes(model: DecoderModel) -> dict[str, ModuleShape]:
    """(in, out) of each LoRA-able projection, by its peft name: what an adapter must match
    (the base check). A family whose checkpoint fuses q/k/v and gate/up (Phi-3) is adapted on
    `qkv_proj` and `gate_up_proj` instead of their parts."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hidden = model.config.hidden_size
    inter = getattr(mlp, "intermediate", None)
    outs = {"q_proj": attn.q_size, "k_proj": attn.kv_size, "v_proj": attn.kv_size,
            "qkv_proj": attn.q_size + 2 * attn.kv_size, "o_proj": hidden,
            "gate_proj": inter, "up_proj": inter, "gate_up_proj": None if inter is None
            else 2 * inter, "down_proj": hidden}
    ins = {"o_proj": attn.q_size, "down_proj": inter}
    modules = [m for members in model.lora_packing().values() for m in members]
    return {m: ModuleShape(ins.get(m, hidden), outs[m]) for m in modules
            if outs[m] is not None and ins.get(m, hidden) is not None}
