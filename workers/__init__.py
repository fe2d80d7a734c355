"""Switchboard's inference engine: paged KV cache, continuous batching, chunked prefill.

Public API: `LLM`, `SamplingParams`, `AsyncLLMEngine`, `RequestOutput`.
"""

from workers.async_engine import AsyncLLMEngine
from workers.config import EngineArgs
from workers.engine.outputs import CompletionOutput, RequestOutput
from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.llm import LLM
from workers.llm_engine import EngineOverloadedError, LLMEngine

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
