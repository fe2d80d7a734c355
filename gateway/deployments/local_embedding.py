"""An embedding model in this process: the bundled all-MiniLM-L6-v2 (or a BERT-style folder).

Loading is the semantic cache's (`caching.embedder.Embedder`); what this adds is a forward over
token ids, so inputs are tokenized once, in `prepare`, and the token counts admission reserves
are the ones billed. Forwards run on the embedder's own thread, micro-batched across concurrent
requests (`gateway.deployments.batcher`); mean pooling under the attention mask makes a row's
vector independent of what it was batched with (padding is masked out), to float rounding.

An input longer than the model's window is refused (400 `context_length_exceeded`, as OpenAI
does), not cut: a cut input would be billed and embedded as if it were whole. A request whose
inputs add up to more tokens than the deployment's `max_request_tokens` is refused too (400
`embedding_work_exceeded`), before any forward: the bound keeps the largest request within
the route's time on a small CPU.

Tenants share the model fairly (`call.share`: the key's tenant and its plan's weight), and
`call.usage.prompt_tokens` follows the rows computed, so a request cut short (the client left)
pays for the work done on it, not nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from caching.embedder import MAX_TOKENS, Embedder, bundled_model_dir
from gateway.deployments.base import Call, UpstreamFailure
from gateway.deployments.batcher import MicroBatcher, Rows
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.embedding import Answering, EmbeddingDeployment, rendered
from gateway.errors import bad_request
from gateway.schemas.embeddings import EmbeddingRequest, unknown_field

T = TypeVar("T")


class TokenEncoder(Embedder):
    """The embedder, reading token ids: [CLS] ids [SEP] -> a unit vector of `dim` floats."""

    window: int = MAX_TOKENS
    vocab_size: int = 0

    def load(self) -> None:
        super().load()
        config = self._model.config
        self.dim = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.window = _trained_window(self.model_dir or bundled_model_dir(),
                                      int(config.max_position_embeddings))

    def tokenize(self, texts: list[str]) -> Rows:
        """Word pieces with [CLS] and [SEP], uncut (a fast tokenizer, in Rust)."""
        return self._tokenizer(texts, add_special_tokens=True, truncation=False,
                               verbose=False)["input_ids"]

    def framed(self, ids: list[int]) -> list[int]:
        """Token ids as a text of them would read: between [CLS] and [SEP]."""
        return [self._tokenizer.cls_token_id, *ids, self._tokenizer.sep_token_id]

    def forward(self, rows: Rows) -> np.ndarray:
        """Unit vectors [len(rows), dim]: the mean of token states under the attention mask."""
        import torch

        longest = max(len(row) for row in rows)
        ids = torch.full((len(rows), longest), self._tokenizer.pad_token_id or 0,
                         dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            states = self._model(input_ids=ids, attention_mask=mask,
                                 token_type_ids=torch.zeros_like(ids)).last_hidden_state
            weights = mask.unsqueeze(-1).to(states.dtype)
            pooled = (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu().numpy()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """On the embedder's own thread (one model, one thread)."""
        return await self._run(fn, *args)


def _trained_window(folder: Path, positions: int) -> int:
    """The window the model was trained on (sentence-transformers' max_seq_length), else its
    position embeddings."""
    config = folder / "sentence_bert_config.json"
    if config.is_file():
        length = json.loads(config.read_text()).get("max_seq_length")
        if isinstance(length, int) and 0 < length <= positions:
            return length
    return positions


class LocalEmbeddingDeployment(EmbeddingDeployment):
    """`provider: embedded, mode: embedding`: `upstream_model` "default" (the bundled
    all-MiniLM-L6-v2) or a model folder."""

    def __init__(self, config: DeploymentConfig, *, device: str | None = None,
                 max_batch_rows: int = 64, max_batch_tokens: int = 4096,
                 max_request_tokens: int | None = None) -> None:
        super().__init__(config)
        self._default_bound = max_request_tokens
        model = config.upstream_model
        folder = None if model in (None, "default") else Path(model)
        self.encoder = TokenEncoder(folder, device=device or "cpu")
        self.batcher = MicroBatcher(self._forward, max_rows=max_batch_rows,
                                    max_tokens=max_batch_tokens)

    async def start(self) -> None:
        await self.encoder.run(self.encoder.load)

    async def close(self) -> None:
        await self.batcher.close()
        await self.encoder.close()

    def stats(self) -> dict[str, float]:
        return {"queued_rows": float(self.batcher.pending_rows)}

    @property
    def max_request_tokens(self) -> int | None:
        """The config's bound, else the gateway's (`embedding_max_request_tokens`)."""
        configured = self.config.max_request_tokens
        return configured if configured is not None else self._default_bound

    def tenant_tokens(self) -> dict[str, int]:
        return dict(self.batcher.tokens)

    @property
    def window(self) -> int:
        return min(self.config.context_window, self.encoder.window)

    @property
    def tokenizes(self) -> bool:
        return True

    def prepare_embedding(self, request: EmbeddingRequest, *,
                          plan_bound: int | None = None) -> Call:
        extras = request.extra_fields()
        if extras:  # nothing outside OpenAI's schema means anything to this model
            raise unknown_field(extras[0])
        encoder = self.encoder
        if request.dimensions is not None and request.dimensions != encoder.dim:
            raise bad_request(f"The model '{request.model}' makes {encoder.dim}-dimensional "
                              "embeddings only; it does not support 'dimensions'.",
                              param="dimensions", code="unsupported_parameter")
        inputs = request.inputs()
        if isinstance(inputs[0], str):
            rows = encoder.tokenize(inputs)  # type: ignore[arg-type]
        else:
            rows = [encoder.framed(self._known(ids)) for ids in inputs]  # type: ignore[arg-type]
        for index, row in enumerate(rows):
            if len(row) > self.window:
                where = "" if len(rows) == 1 else f" (input {index})"
                raise bad_request(
                    f"This model's maximum context length is {self.window} tokens, however "
                    f"you requested {len(row)} tokens{where}. Please reduce your input.",
                    param="input", code="context_length_exceeded")
        tokens = sum(len(row) for row in rows)
        self.check_work(tokens, len(rows), bound=plan_bound)
        return Call(request, False, prompt_tokens=tokens, max_output_tokens=0,  # type: ignore[arg-type]
                    native=rows)

    def _known(self, ids: list[int]) -> list[int]:
        vocab = self.encoder.vocab_size
        for token in ids:
            if token >= vocab:
                raise bad_request(f"Token id {token} is outside this model's vocabulary "
                                  f"(0..{vocab - 1}).", param="input", code="invalid_value")
        return ids

    async def embed(self, call: Call, *, request_id: str,
                    answering: Answering | None = None) -> bytes:
        """Rows from every tenant's requests share forwards fairly (`call.share`); the usage
        counts the tokens of the rows computed as they finish. The first of them is the answer
        starting (`answering`): from then on the route's deadline no longer cuts it, as an
        engine's first event does for a completion."""
        rows: Rows = call.native
        share = call.share
        usage = call.usage

        def progress(tokens: int, gone: bool) -> None:
            if not usage.prompt_tokens and answering is not None and not gone:
                answering()
            usage.prompt_tokens = usage.computed_prompt_tokens = min(tokens, call.prompt_tokens)

        try:
            vectors = await self.batcher.embed(
                rows, tenant=share.tenant if share is not None else "",
                weight=share.weight if share is not None else 1.0,
                priority=share.priority if share is not None else 0, progress=progress)
        except RuntimeError as exc:  # the model failed (out of memory, closed): try another
            raise UpstreamFailure(503, "the embedding model failed", code="worker_failed"
                                  ) from exc
        usage.prompt_tokens = usage.computed_prompt_tokens = call.prompt_tokens
        usage.finished = True
        return await rendered(vectors, call)

    async def _forward(self, rows: Rows) -> np.ndarray:
        return await self.encoder.run(self.encoder.forward, rows)
