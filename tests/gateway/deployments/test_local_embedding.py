"""The bundled all-MiniLM-L6-v2 as an embedding deployment: batching never changes a vector,
token counts are the tokenizer's, and what the model cannot do is refused by name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from caching.embedder import Embedder
from gateway.deployments.base import EngineShare
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


async def test_a_request_over_the_bound_is_refused_before_any_forward() -> None:
    config = DeploymentConfig(name="emb", model_name="minilm", provider="embedded",
                              mode="embedding", upstream_model="default")
    deployment = LocalEmbeddingDeployment(config, max_request_tokens=1000)
    await deployment.start()
    try:
        ids = [[2000 + i for i in range(254)]] * 4  # 4 x 256 tokens with [CLS] and [SEP]
        with pytest.raises(APIError) as caught:
            deployment.prepare_embedding(request(input=ids))
        error = caught.value
        assert (error.status, error.param, error.code) == (400, "input",
                                                           "embedding_work_exceeded")
        assert "1024 tokens" in error.message and "at most 1000" in error.message
        assert "4 inputs" in error.message
        assert deployment.batcher.forwards == 0
        assert deployment.prepare_embedding(request(input=ids[:3])).prompt_tokens == 768
        # a deployment's own bound replaces the gateway's
        own = LocalEmbeddingDeployment(config.model_copy(update={"max_request_tokens": 500}),
                                       max_request_tokens=1000)
        assert own.max_request_tokens == 500
        own.encoder = deployment.encoder
        with pytest.raises(APIError):
            own.prepare_embedding(request(input=ids[:2]))
    finally:
        await deployment.close()


async def test_embed_runs_in_the_caller_s_share_and_counts_rows_as_they_finish(
        minilm: LocalEmbeddingDeployment) -> None:
    minilm.batcher.max_rows = 2
    call = minilm.prepare_embedding(request(input=["one", "two words", "three more words"]))
    call.share = EngineShare("tenant-a", 2.0)
    seen: list[int] = []
    started: list[int] = []
    forward = minilm.batcher._forward

    async def watched(rows):  # the usage before each forward: the rows done so far
        seen.append(call.usage.prompt_tokens)
        return await forward(rows)

    minilm.batcher._forward = watched
    body = await minilm.embed(call, request_id="r", answering=lambda: started.append(1))
    assert seen == [0, 3 + 4]  # [CLS] one [SEP], [CLS] two words [SEP]
    assert call.usage.prompt_tokens == call.prompt_tokens == 3 + 4 + 5
    assert call.usage.finished and started == [1] and b'"prompt_tokens":12' in body
    assert minilm.tenant_tokens() == {"tenant-a": 12}


async def test_a_cut_call_keeps_the_tokens_computed(minilm: LocalEmbeddingDeployment) -> None:
    minilm.batcher.max_rows = 1
    call = minilm.prepare_embedding(request(input=["a b", "c d", "e f", "g h"]))
    second = asyncio.Event()
    hold = asyncio.Event()
    forward = minilm.batcher._forward

    async def held(rows):
        if minilm.batcher.forwards == 1:  # the second forward: computed, held
            second.set()
            await hold.wait()
        return await forward(rows)

    minilm.batcher._forward = held
    task = asyncio.ensure_future(minilm.embed(call, request_id="r"))
    await second.wait()
    assert call.usage.prompt_tokens == 4
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    hold.set()
    assert not call.usage.finished
    # the first row, and the second one's forward (it runs to its end): two rows of 4
    assert call.usage.prompt_tokens == 8 < call.prompt_tokens == 16
