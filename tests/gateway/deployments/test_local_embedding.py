"""The bundled all-MiniLM-L6-v2 as an embedding deployment: batching never changes a vector,
token counts are the tokenizer's, and what the model cannot do is refused by name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from caching.embedder import Embedder
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.local_embedding import LocalEmbeddingDeployment
from gateway.errors import APIError
from gateway.schemas.embeddings import EmbeddingRequest

TEXT = "Embeddings of the same text must not depend on their neighbours."
LONG = " ".join(["a much longer neighbour that pads the batch"] * 20)


@pytest.fixture
async def minilm() -> AsyncIterator[LocalEmbeddingDeployment]:
    config = DeploymentConfig(name="emb", model_name="minilm", provider="embedded",
                              mode="embedding", upstream_model="default")
    deployment = LocalEmbeddingDeployment(config, max_batch_rows=8)
    await deployment.start()
    yield deployment
    await deployment.close()


def request(**body: object) -> EmbeddingRequest:
    return EmbeddingRequest.model_validate({"model": "minilm", **body})


async def embed(deployment: LocalEmbeddingDeployment, inputs: list[str]) -> np.ndarray:
    call = deployment.prepare_embedding(request(input=inputs))
    return await deployment.batcher.embed(call.native)


async def test_batch_composition_never_changes_a_vector(minilm: LocalEmbeddingDeployment
                                                        ) -> None:
    alone = (await embed(minilm, [TEXT]))[0]
    assert alone.shape == (384,) and abs(float(np.linalg.norm(alone)) - 1) < 1e-5
    padded = (await embed(minilm, [LONG, TEXT, "short"]))[1]
    many = (await embed(minilm, [f"text {i} {LONG[: 7 * i]}" for i in range(20)] + [TEXT]))[-1]
    together = await asyncio.gather(*(embed(minilm, [LONG[: 11 * i] or "x", TEXT])
                                      for i in range(12)))
    for vector in (padded, many, *(pair[1] for pair in together)):
        assert np.abs(vector - alone).max() < 1e-5
    assert minilm.batcher.forwards < 3 + 2 + 12  # the concurrent ones shared forwards


async def test_same_vectors_as_the_semantic_cache(minilm: LocalEmbeddingDeployment) -> None:
    cache = Embedder()
    try:
        expected = await asyncio.to_thread(cache.embed_sync, [TEXT, "a second one"])
    finally:
        await cache.close()
    assert np.abs(await embed(minilm, [TEXT, "a second one"]) - expected).max() < 1e-5


async def test_token_counts_are_the_tokenizer_s(minilm: LocalEmbeddingDeployment) -> None:
    call = minilm.prepare_embedding(request(input=["hello world", TEXT]))
    assert call.prompt_tokens == sum(len(r) for r in minilm.encoder.tokenize(
        ["hello world", TEXT]))
    assert call.native[0][0] == 101 and call.native[0][-1] == 102  # [CLS] ... [SEP]
    assert call.max_output_tokens == 0


async def test_refusals(minilm: LocalEmbeddingDeployment) -> None:
    with pytest.raises(APIError) as caught:
        minilm.prepare_embedding(request(input="x", dimensions=256))
    assert (caught.value.param, caught.value.code) == ("dimensions", "unsupported_parameter")
    with pytest.raises(APIError) as caught:
        minilm.prepare_embedding(request(input="x", input_type="query"))
    assert (caught.value.param, caught.value.code) == ("input_type", "unknown_parameter")
    with pytest.raises(APIError) as caught:
        minilm.prepare_embedding(request(input=["ok", "word " * 300]))
    assert caught.value.code == "context_length_exceeded" and "(input 1)" in caught.value.message
    assert minilm.window == 256
    with pytest.raises(APIError):
        minilm.prepare(request(input="x"), chat=True, tenant_id="t")  # type: ignore[arg-type]
