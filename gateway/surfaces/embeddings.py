"""OpenAI's embeddings as a surface: its body is its own canonical request (an
`EmbeddingRequest`), and its answer the deployment's OpenAI body, rendered there (it comes
whole: there is no stream, no event and no fold).

What an embedding asks of the path differs from a completion only where the `EMBEDDING` kind
says (`gateway.surfaces.Kind`): it routes to `mode: embedding` deployments, asks no stream,
priority or logprobs and has no fields for routing to check (no tools), is prepared by the
deployment's `prepare_embedding` under the plan's `embedding_max_request_tokens`, is one
`embed` a try, and is not kept in the response cache (it is cheap to recompute).
Authentication, admission in two steps, dispatch with fallbacks and settlement are the
completions' own (`gateway.request_path`): an embedding bills its input tokens, as the rows
computed so far when it is cut short, because that is all its usage ever holds.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from gateway.deployments.base import AdapterRef, Call, Deployment
from gateway.deployments.embedding import (
    EmbeddingDeployment,
    estimated_embedding_call,
    not_an_embedding_model,
)
from gateway.errors import bad_request
from gateway.schemas.embeddings import EmbeddingRequest, check_inputs
from tenancy.context import KeyContext
from workers.protocol.requests import request_error


def parse(raw: bytes) -> EmbeddingRequest:
    """The body, or a 400 naming what is wrong with it (worded as the completions')."""
    try:
        body = EmbeddingRequest.model_validate_json(raw)
    except ValidationError as exc:
        error = request_error(exc)
        raise bad_request(str(error), param=error.param, code=error.code) from None
    check_inputs(body.inputs())
    return body


def _embedding(deployment: Deployment, model: str) -> EmbeddingDeployment:
    """The deployment, or the 400 for a model that serves completions only."""
    if not isinstance(deployment, EmbeddingDeployment):
        raise not_an_embedding_model(model)
    return deployment


def prepare(deployment: Deployment, body: EmbeddingRequest, *, chat: bool, key: KeyContext,
            adapter: AdapterRef | None) -> Call:
    """Exactly: the model in this process tokenizes; the plan may lower the work bound."""
    return _embedding(deployment, body.model).prepare_embedding(
        body, plan_bound=key.plan.embedding_max_request_tokens)


def estimate(deployment: Deployment, body: EmbeddingRequest, *, chat: bool, key: KeyContext,
             adapter: AdapterRef | None) -> Call:
    """Four characters a token, for admission's first step: no tokenizer runs before it."""
    _embedding(deployment, body.model)
    return estimated_embedding_call(body)


async def attempt(deployment: Deployment, call: Call, *, stream: bool, request_id: str,
                  answering: Callable[[], None]) -> bytes:
    """One try at the embeddings body (the fallbacks' `run`). Once the deployment is
    computing (its first inputs done) the route's deadline no longer cuts it: as for a
    completion's first event, a request making progress runs to its end."""
    embedder = _embedding(deployment, call.request.model)
    return await embedder.embed(call, request_id=request_id, answering=answering)
