"""The bundled all-MiniLM-L6-v2: unit vectors where paraphrases are nearer than unrelated text."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from caching.embedder import MAX_TOKENS, Embedder, bundled_model_dir


def test_bundled_model_is_found() -> None:
    folder = bundled_model_dir()
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


def test_constructor_does_no_io(tmp_path) -> None:
    model = Embedder(tmp_path / "does-not-exist")
    assert not model.loaded  # a bad folder only fails on load
    with pytest.raises(OSError):
        model.load()


def test_vectors_are_unit_length_384(embedder: Embedder) -> None:
    vectors = embedder.embed_sync(["hello there", "a much longer sentence about cooking rice"])
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    assert np.linalg.norm(vectors, axis=1) == pytest.approx([1.0, 1.0], abs=1e-5)
    assert embedder.embed_sync([]).shape == (0, 384)


def test_paraphrase_is_nearer_than_unrelated(embedder: Embedder) -> None:
    q, para, other = embedder.embed_sync([
        "How do I reset my password?",
        "What are the steps to reset my password?",
        "What is the boiling point of water?",
    ])
    assert float(q @ para) > 0.8
    assert float(q @ other) < 0.3


def test_padding_does_not_change_a_vector(embedder: Embedder) -> None:
    alone = embedder.embed_sync(["short"])[0]
    batched = embedder.embed_sync(["short", "a far longer text that forces padding " * 5])[0]
    assert float(alone @ batched) == pytest.approx(1.0, abs=1e-5)


async def test_async_embed_matches_sync(embedder: Embedder) -> None:
    vector = await embedder.embed("Why is the sky blue?")
    assert vector.shape == (384,)
    assert vector == pytest.approx(embedder.embed_sync(["Why is the sky blue?"])[0], abs=1e-5)


async def test_embed_checked_refuses_text_past_the_window(embedder: Embedder) -> None:
    assert await embedder.embed_checked("short question?") is not None
    long_text = "word " * (MAX_TOKENS + 10)
    assert not embedder.fits(long_text)
    assert await embedder.embed_checked(long_text) is None


async def test_concurrent_first_calls_share_one_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModel

    loads = []
    original = AutoModel.from_pretrained

    def counting(*args, **kwargs):
        loads.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModel, "from_pretrained", counting)
    fresh = Embedder()
    try:
        vectors = await asyncio.gather(*[fresh.embed(f"question {i}") for i in range(4)])
    finally:
        await fresh.close()
    assert len(loads) == 1 and fresh.loaded
    assert all(v.shape == (384,) for v in vectors)
