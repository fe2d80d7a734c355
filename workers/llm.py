"""Offline batch inference: `LLM(model).generate(prompts, params)`, as vLLM users know it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.llm_engine import LLMEngine


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_args(model=model, **engine_args)
        self._counter = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs keep the input order.

        `lora` names a registered adapter for all prompts, or one (or None) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError("need one adapter (or None) per prompt")
        # Validate everything first: a bad prompt must not leave the others queued.
        prepared = [
            self.engine.prepare_request(prompt, p, lora=name)
            for prompt, p, name in zip(prompts, params_list, loras, strict=True)
        ]
        ids = []
        for i, request in enumerate(prepared):
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.engine.enqueue(request_id, request, priority=priority[i] if priority else 0)
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in ids]

    def add_lora(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Register a peft adapter under `name` (needs enable_lora=True)."""
        self.engine.add_lora(name, str(path), pinned=pinned)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [
            self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)
