"""Deployments in mode "embedding": they serve POST /v1/embeddings and nothing else.

An embedding call is a `Call` whose request is an `EmbeddingRequest` and whose `complete`
returns the OpenAI embeddings body, so the chat path's fallbacks, breakers and admission work
on it unchanged. Asked for a chat or text completion, these deployments answer a 400 naming
the endpoint that serves them.

Three kinds: the bundled all-MiniLM-L6-v2 in this process (`gateway.deployments.
local_embedding`), an OpenAI-compatible HTTP upstream (`provider: openai|worker`, POST
{base_url}/embeddings), and any provider litellm knows (`litellm.aembedding`). The upstream
key is the deployment's own, server-side; the caller's key never leaves the gateway.

A deployment may bound the work of one request (`max_request_tokens`: all its inputs' tokens
together); a larger request is a 400 `embedding_work_exceeded` before anything runs. The model
in this process counts exactly and is bounded by default (`embedding_max_request_tokens`); an
upstream is bounded only where its config says so, on the estimate.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import time
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import numpy as np

from gateway.deployments.base import AdapterRef, Call, Deployment, UpstreamFailure
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.external import LiteLLMDeployment, load_litellm
from gateway.deployments.http import check_response, upstream_failure
from gateway.deployments.http_pool import HttpPool
from gateway.errors import APIError, bad_request
from gateway.observability.tracing import inject_trace_headers
from gateway.schemas.embeddings import (
    EmbeddingRequest,
    as_format,
    encode_vector,
    render_embeddings,
    unknown_field,
)
from workers.protocol.events import Event
from workers.protocol.requests import OpenAIRequest

CONTEXT_CODE = "context_length_exceeded"
WORK_CODE = "embedding_work_exceeded"
Answering = Callable[[], None]  # the answer has started: the route's deadline stops there
# Bodies bigger than these are parsed or encoded on a thread, not on the event loop.
OFF_LOOP_BYTES = 256 << 10
OFF_LOOP_FLOATS = 16_384


def wrong_endpoint(model: str) -> APIError:
    return bad_request(f"The model '{model}' is an embedding model: it serves "
                       "POST /v1/embeddings only.", param="model", code="model_not_supported")


def not_an_embedding_model(model: str) -> APIError:
    return bad_request(f"The model '{model}' does not serve embeddings: use it with "
                       "/v1/chat/completions or /v1/completions.", param="model",
                       code="model_not_supported")


class EmbeddingDeployment(Deployment):
    """What every embedding deployment shares: the refusal of chat, and `embed`."""

    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                adapter: AdapterRef | None = None) -> Call:
        raise wrong_endpoint(request.model)

    async def open(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
        raise wrong_endpoint(call.request.model)
        yield  # an async generator, like every deployment's `open`

    @abstractmethod
    def prepare_embedding(self, request: EmbeddingRequest, *,
                          plan_bound: int | None = None) -> Call:
        """Validate and count tokens; a 400 for what this deployment refuses (a request over
        its bound, or over `plan_bound`, the caller's plan's, where that is smaller)."""

    @abstractmethod
    async def embed(self, call: Call, *, request_id: str,
                    answering: Answering | None = None) -> bytes:
        """The OpenAI embeddings body, with `model` the name the caller asked for.

        `call.usage.prompt_tokens` is what the call has cost so far (the rows computed, where
        the deployment knows; else 0 until the answer); `answering` is called once the work
        has visibly started, where it can be seen (the model in this process)."""

    @property
    def max_request_tokens(self) -> int | None:
        """The most input tokens one request may embed here (None: no bound)."""
        return self.config.max_request_tokens

    def check_work(self, tokens: int, rows: int, *, bound: int | None = None,
                   estimated: bool = False) -> None:
        """A 400 for a request larger than this deployment's bound (or `bound`, a plan's,
        where it is smaller), before anything is computed or sent."""
        bounds = [b for b in (self.max_request_tokens, bound) if b is not None]
        if bounds and tokens > min(bounds):
            about = "about " if estimated else ""
            raise bad_request(
                f"This request's {rows} input{'s' if rows != 1 else ''} add up to {about}"
                f"{tokens} tokens; '{self.config.model_name}' embeds at most {min(bounds)} "
                "tokens in one request. Please send the inputs in several requests.",
                param="input", code=WORK_CODE)

    def refuse_unknown_fields(self, request: EmbeddingRequest) -> None:
        """Fields outside OpenAI's schema go only where the config passes them through."""
        allowed = set(self.config.passthrough_fields)
        for name in request.extra_fields():
            if name not in allowed:
                raise unknown_field(name)


def estimated_embedding_call(request: EmbeddingRequest) -> Call:
    """A call on an upstream whose tokenizer does not run here: four characters a token (a
    token id counts one), for admission; the upstream's own count is what is billed."""
    prompt_tokens = sum(_estimated_tokens(item) if isinstance(item, str) else len(item)
                        for item in request.inputs())
    return Call(request, False, prompt_tokens=prompt_tokens, max_output_tokens=0)  # type: ignore[arg-type]


def bounded_estimate(deployment: EmbeddingDeployment, request: EmbeddingRequest,
                     plan_bound: int | None = None) -> Call:
    """The estimated call, refused where it exceeds the deployment's configured bound (or
    the plan's)."""
    call = estimated_embedding_call(request)
    deployment.check_work(call.prompt_tokens, len(request.inputs()), bound=plan_bound,
                          estimated=True)
    return call


def _estimated_tokens(text: str) -> int:
    """Four ASCII characters a token, and a token for every byte outside ASCII (as for
    completions: `base.estimated_prompt_tokens`)."""
    if text.isascii():
        return math.ceil(len(text) / 4) + 1
    data = text.encode()
    ascii_chars = len(data.decode("ascii", "ignore"))
    return math.ceil(ascii_chars / 4) + (len(data) - ascii_chars) + 1


class HttpEmbeddingDeployment(EmbeddingDeployment):
    """An OpenAI-compatible upstream's POST {base_url}/embeddings, on the shared pool."""

    def __init__(self, config: DeploymentConfig, pool: HttpPool, *, secret: str = "",
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__(config)
        self._pool = pool
        self._url = f"{(config.base_url or '').rstrip('/')}/embeddings"
        self._headers = {"content-type": "application/json"}
        key = config.secret() or secret  # a worker's shared secret when it has no key of its own
        if key:
            self._headers["authorization"] = f"Bearer {key}"
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._tls: ssl.SSLContext | bool = tls if tls is not None else True

    def prepare_embedding(self, request: EmbeddingRequest, *,
                          plan_bound: int | None = None) -> Call:
        self.refuse_unknown_fields(request)
        return bounded_estimate(self, request, plan_bound)

    async def embed(self, call: Call, *, request_id: str,
                    answering: Answering | None = None) -> bytes:
        request: EmbeddingRequest = call.request  # type: ignore[assignment]
        body = request.upstream_body()
        body["model"] = self.config.upstream_model or self.config.model_name
        headers = {**self._headers, "x-request-id": request_id}
        inject_trace_headers(headers)
        started = time.perf_counter()
        try:
            async with self._pool.session.post(
                    self._url, data=json.dumps(body, separators=(",", ":")).encode(),
                    headers=headers, timeout=self._timeout, ssl=self._tls) as resp:
                await check_response(resp)
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise upstream_failure(exc) from None
        except APIError as exc:
            raise _about_input(exc) from None
        finally:
            call.upstream_s += time.perf_counter() - started
        return await reshaped(raw, call)


class LiteLLMEmbeddingDeployment(EmbeddingDeployment, LiteLLMDeployment):
    """`litellm.aembedding` with the deployment's model string, key and base URL; litellm's
    start (provider check, cost-map price), close and error mapping are the chat one's."""

    def prepare_embedding(self, request: EmbeddingRequest, *,
                          plan_bound: int | None = None) -> Call:
        self.refuse_unknown_fields(request)
        return bounded_estimate(self, request, plan_bound)

    async def embed(self, call: Call, *, request_id: str,
                    answering: Answering | None = None) -> bytes:
        litellm = load_litellm()
        request: EmbeddingRequest = call.request  # type: ignore[assignment]
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                response = await litellm.aembedding(**self._embedding_kwargs(request,
                                                                             request_id))
        except Exception as exc:
            failure = self._failure(exc, call)
            raise (_about_input(failure) if isinstance(failure, APIError) else failure) from None
        finally:
            call.upstream_s += time.perf_counter() - started
        data = response if isinstance(response, dict) else response.model_dump()
        return await reshaped(data, call)

    def _embedding_kwargs(self, request: EmbeddingRequest, request_id: str) -> dict[str, Any]:
        """Only what an embeddings request may set; never where or how litellm connects."""
        kwargs: dict[str, Any] = {
            "model": self.config.upstream_model, "input": request.inputs(),
            "timeout": self.config.timeout_s, "num_retries": 0, "max_retries": 0,
            "extra_headers": {"x-request-id": request_id},
        }
        sent = request.upstream_body()
        # Floats from litellm (whose OpenAI client fetches base64 on the wire and decodes it),
        # encoded here as the caller asked: other providers know no `encoding_format`.
        for name in ("dimensions", "user"):
            if name in sent:
                kwargs[name] = sent[name]
        extras = {name: sent[name] for name in request.extra_fields()}
        if extras:
            kwargs["extra_body"] = extras
        if self.config.base_url:
            kwargs["api_base"] = self.config.base_url
        if self._api_key:
            kwargs["api_key"] = self._api_key
        return kwargs


def _about_input(exc: APIError) -> APIError:
    """An upstream's refusal of an over-long input names `input` (the fallbacks then try a
    deployment with a larger window)."""
    if exc.code == CONTEXT_CODE:
        exc.param = "input"
    return exc


async def reshaped(upstream: bytes | dict[str, Any], call: Call) -> bytes:
    """An upstream's embeddings answer in OpenAI's shape, in the format the caller asked for,
    under the model name the caller asked for; its usage is adopted for billing."""
    request: EmbeddingRequest = call.request  # type: ignore[assignment]
    size = len(upstream) if isinstance(upstream, bytes) else 0
    expected = len(request.inputs())

    def work() -> tuple[bytes, int]:
        data = json.loads(upstream) if isinstance(upstream, bytes) else upstream
        items = data.get("data") if isinstance(data, dict) else None
        if not isinstance(items, list) or len(items) != expected:
            raise ValueError(f"expected {expected} embeddings")
        ordered = sorted(items, key=lambda item: item.get("index", 0))
        embeddings = [as_format(item.get("embedding"), request.encoding_format)
                      for item in ordered]
        usage = data.get("usage") or {}
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        tokens = tokens if isinstance(tokens, int) and tokens >= 0 else call.prompt_tokens
        return render_embeddings(embeddings, model=request.model, prompt_tokens=tokens), tokens

    try:
        body, tokens = (await asyncio.to_thread(work)) if size > OFF_LOOP_BYTES else work()
    except (ValueError, TypeError, AttributeError) as exc:
        raise UpstreamFailure(502, f"upstream sent an invalid embeddings response ({exc})"
                              ) from None
    call.usage.prompt_tokens = tokens
    call.usage.finished = True
    return body


async def rendered(vectors: np.ndarray, call: Call) -> bytes:
    """Vectors computed here as the OpenAI body, in the format the caller asked for."""
    request: EmbeddingRequest = call.request  # type: ignore[assignment]

    def work() -> bytes:
        embeddings = [encode_vector(v, request.encoding_format) for v in vectors]
        return render_embeddings(embeddings, model=request.model,
                                 prompt_tokens=call.usage.prompt_tokens)

    return (await asyncio.to_thread(work)) if vectors.size > OFF_LOOP_FLOATS else work()


def build_embedding_deployment(config: DeploymentConfig, *, pool: HttpPool,
                               worker_secret: str = "", worker_tls: ssl.SSLContext | None = None,
                               device: str | None = None, max_batch_rows: int = 64,
                               max_batch_tokens: int = 4096,
                               max_request_tokens: int | None = None) -> EmbeddingDeployment:
    """The embedding deployment a config describes (no I/O: `start` loads or connects).

    `max_request_tokens`: the bound of the model in this process when its config sets none
    (the gateway's `embedding_max_request_tokens`); upstreams keep their config's."""
    if config.provider == "litellm":
        return LiteLLMEmbeddingDeployment(config)
    if config.provider in ("openai", "worker"):
        worker = config.provider == "worker"
        return HttpEmbeddingDeployment(config, pool, secret=worker_secret if worker else "",
                                       tls=worker_tls if worker else None)
    from gateway.deployments.local_embedding import LocalEmbeddingDeployment  # imports torch

    return LocalEmbeddingDeployment(config, device=device, max_batch_rows=max_batch_rows,
                                    max_batch_tokens=max_batch_tokens,
                                    max_request_tokens=max_request_tokens)
