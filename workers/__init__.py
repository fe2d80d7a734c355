"""Switchboard's inference engine: paged KV cache, continuous batching, chunked prefill.

Public API: `LLM`, `SamplingParams`, `AsyncLLMEngine`, `RequestOutput`.

The names are resolved on first use (PEP 562), so importing the torch-free core
(`workers.engine`, `workers.tools`) does not load torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.async_engine import AsyncLLMEngine
    from workers.config import EngineArgs
    from workers.engine.outputs import CompletionOutput, RequestOutput
    from workers.engine.sampling_params import InvalidRequestError, SamplingParams
    from workers.llm import LLM
    from workers.llm_engine import EngineOverloadedError, LLMEngine

_HOMES = {
    "AsyncLLMEngine": "workers.async_engine",
    "EngineArgs": "workers.config",
    "CompletionOutput": "workers.engine.outputs",
    "RequestOutput": "workers.engine.outputs",
    "InvalidRequestError": "workers.engine.sampling_params",
    "SamplingParams": "workers.engine.sampling_params",
    "LLM": "workers.llm",
    "EngineOverloadedError": "workers.llm_engine",
    "LLMEngine": "workers.llm_engine",
}

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineOverloadedError",
    "InvalidRequestError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'workers' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
