"""Loading an engine's parts from `EngineArgs`: the model folder, tokenizer, config, weights.

Apart from the core, which steps whatever runner it is handed: this is where transformers
and the runner's torch come in, imported when a model is loaded, not when this is imported.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from workers.config import EngineArgs
from workers.engine.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    tokenizer: Any
    runner: Any  # a ModelRunner, its KV pool allocated
    eos_token_ids: list[int]
    vocab_size: int


def load_model(args: EngineArgs) -> LoadedModel:
    """Load tokenizer, config and weights (the default model when `args.model` is None);
    an architecture the engine does not serve is refused before anything loads."""
    from transformers import AutoConfig, AutoTokenizer

    from workers.model_files import resolve_model
    from workers.runner.cuda_graphs import capture_sizes
    from workers.runner.model_runner import ModelRunner, RunnerConfig, pick_device, pick_dtype
    from workers.runner.models import check_model_folder

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
            keep_host_heap=args.keep_host_heap,
            decode_graph_sizes=capture_sizes(args.max_num_seqs, args.cuda_graph_sizes)
            if args.cuda_graphs else (),
            draft_model=resolve_model(draft) if draft else None,
        ),
        hf_config,
        eos,
    )
    logger.info(
        "engine ready: %s on %s, %d KV tokens, max_model_len %d, %s attention (%s prefill), "
        "%s linear, %s element-wise, decode graphs %s", folder.name, device,
        runner.num_blocks * args.block_size, runner.max_model_len, runner.attention_backend,
        runner.prefill_attention, runner.linear_backend, runner.model.elementwise,
        list(runner.graphs.sizes) if getattr(runner, "graphs", None) else "off",
    )
    return LoadedModel(tokenizer, runner, eos, hf_config.vocab_size)


def _eos_token_ids(hf_config: Any, tokenizer: Any) -> list[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = ids if isinstance(ids, list) else [ids]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({i for i in ids if i is not None})
