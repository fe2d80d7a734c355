"""What every deployment offers the request path: prepare, then open the answer as typed
events (`workers.protocol.events`); and, where it can apply tenants' LoRA adapters, loading
and unloading them. Streamed or not, every answer crosses this boundary the same way: a
non-streamed response is the fold of the events, rendered once by the gateway."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.deployments.config import DeploymentConfig, Price
from gateway.errors import APIError, bad_request, model_not_found
from workers.engine.prefix_hash import PrefixSummary
from workers.protocol.events import Event, Failed
from workers.protocol.requests import OpenAIRequest
from workers.protocol.usage import Usage


class UpstreamFailure(Exception):
    """The deployment could not serve the call (connection, timeout, 5xx, upstream 429).

    The router retries these on the next deployment of the chain, before the first byte has
    reached the client; the last one becomes the client's 502/504/429.
    """

    def __init__(self, status: int, message: str, *, code: str = "upstream_error",
                 retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A tenant's adapter as a deployment loads it.

    `engine_name` is built server-side from the authenticated tenant id and the adapter name
    (`engine_adapter_name`), never taken from the client, so tenants cannot reach each other's
    adapters in a shared engine. `adapter_id` tells a re-created adapter of the same name from
    an old registration."""

    adapter_id: str
    engine_name: str
    path: str
    pinned: bool = False


def engine_adapter_name(tenant_id: str, name: str) -> str:
    return f"{tenant_id}/{name}"


@dataclass(frozen=True, slots=True)
class EngineShare:
    """Whom a call is for, as the engines' fair-share scheduler sees it. Set by the gateway
    from the authenticated key and its plan, never from anything the client sent."""

    tenant: str
    weight: float = 1.0
    priority: int = 0


@dataclass
class Call:
    """One validated call on one deployment, with the numbers admission needs."""

    request: OpenAIRequest
    chat: bool
    prompt_tokens: int  # exact for the embedded engine, an upper estimate for HTTP upstreams
    max_output_tokens: int
    usage: Usage = field(default_factory=Usage)
    native: Any = None  # the deployment's own prepared form
    adapter: AdapterRef | None = None
    upstream_s: float = 0.0  # time spent waiting on the upstream (for x-gateway-overhead-ms)
    share: EngineShare | None = None  # engines schedule by it; other upstreams ignore it


class Deployment(ABC):
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        # Providers with a price list (litellm's cost map) fill this in at start() when the
        # config sets no price.
        self.price: Price = config.configured_price() or Price(source="none")

    @property
    def name(self) -> str:
        return self.config.name

    async def start(self) -> None:  # noqa: B027 - an optional hook
        """Acquire resources (load a model, open a pool). Never called at construction."""

    async def close(self) -> None:  # noqa: B027 - an optional hook
        """Release resources."""

    def stats(self) -> dict[str, float]:
        """Load signals for /health (queue depth, KV use) where the deployment knows them."""
        return {}

    def prefix_summary(self) -> PrefixSummary | None:
        """The Bloom summary of the engine's prefix cache, where a remote worker reports it
        (prefix-aware routing)."""
        return None

    def kv_room(self) -> tuple[int, int] | None:
        """(working-set tokens, pool tokens) of the engine's KV cache, where a worker reports
        them: prefix-aware routing counts what a new prompt would evict there."""
        return None

    def tenant_tokens(self) -> dict[str, int]:
        """Engine tokens computed per tenant id (the fair share), where the deployment runs
        our engine; "" holds requests that named no tenant."""
        return {}

    @property
    def accepting(self) -> bool:
        """Whether to send new requests here (a remote worker may be draining or gone)."""
        return True

    def load(self) -> float | None:
        """The upstream's own report of its load (queue, KV use), where it gives one."""
        return None

    @property
    def tokenizes(self) -> bool:
        """Whether `prepare` runs a tokenizer (the gateway then runs it off the event loop, so
        no request's prompt stalls every other request)."""
        return False

    @property
    def serves_adapters(self) -> bool:
        """Whether this deployment can apply tenants' LoRA adapters (HTTP upstreams cannot)."""
        return False

    async def load_adapter(self, adapter: AdapterRef, *, force: bool = False) -> None:
        """Register the adapter unless it already is (`force`: register again, e.g. to pin)."""
        raise NotImplementedError(f"deployment {self.name!r} serves no adapters")

    async def unload_adapter(self, engine_name: str, *, wait_s: float = 0.0) -> None:
        """Unregister; AdapterBusyError if requests still use it after `wait_s`."""
        raise NotImplementedError(f"deployment {self.name!r} serves no adapters")

    def adapter_residency(self, engine_name: str) -> str | None:
        """Where the adapter is now ("device", "cpu", "disk"), None if not registered here.

        A cheap hint for routing LoRA requests to a deployment that already holds it."""
        return None

    async def adapter_tiers(self) -> dict[str, str]:
        """Engine name -> where each registered adapter lives ("device", "cpu", "disk")."""
        return {}

    def estimate(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                 adapter: AdapterRef | None = None) -> Call:
        """What admission reserves before any tokenizer runs (a request its limits refuse
        costs no tokenizing). Where `prepare` is cheap this is `prepare`; a deployment that
        tokenizes gives an estimate, and is prepared exactly once admitted."""
        return self.prepare(request, chat=chat, tenant_id=tenant_id, adapter=adapter)

    @abstractmethod
    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                adapter: AdapterRef | None = None) -> Call:
        """Validate and count tokens; raise APIError(400) for what this deployment refuses.

        `tenant_id` scopes anything shared between requests (the engine's prefix cache);
        `adapter` is the caller's own adapter, only ever given where `serves_adapters`."""

    @abstractmethod
    def open(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
        """The answer as events, `Opened` first (the upstream is answering).

        A failure before the first event raises from the first `anext` (UpstreamFailure for
        the router to try elsewhere, APIError for the client); after it, the answer ends with
        `Failed`. `call.usage` is kept current as tokens arrive (what a cut answer costs), and
        the closing `Usage` event settles it. Closing the iterator early aborts the upstream."""


def failed(error: APIError | UpstreamFailure) -> Failed:
    """A failure after the first event, as the event that ends the answer."""
    return Failed(error.status, error.message, error.code or "upstream_error")


def estimated_prompt_tokens(request: OpenAIRequest, *, chat: bool) -> int:
    """Without the tokenizer: 4 characters a token, plus a token for every byte of text
    outside ASCII (the most a byte-level tokenizer spends on it: emoji, CJK and Cyrillic
    take far more than a quarter token a character), plus per-message framing."""
    count = len(request.messages) if chat else 1  # type: ignore[union-attr]
    return request.prompt_chars() // 4 + _non_ascii_bytes(request, chat=chat) + 4 * count + 1


def _non_ascii_bytes(request: OpenAIRequest, *, chat: bool) -> int:
    """UTF-8 bytes outside ASCII in the prompt's text (pydantic writes them unescaped)."""
    raw = request.model_dump_json(include={"messages", "tools"} if chat else {"prompt"})
    if raw.isascii():
        return 0
    data = raw.encode()
    return len(data) - len(data.decode("ascii", "ignore"))


def rough_call(request: OpenAIRequest, *, chat: bool, window: int,
               adapter: AdapterRef | None = None) -> Call:
    """An estimate that refuses nothing: 4 characters a token plus per-message framing,
    within the window, for admission only (the exact count comes later)."""
    prompt_tokens = min(estimated_prompt_tokens(request, chat=chat), window - 1)
    max_tokens = request.requested_max_tokens or (window - prompt_tokens)
    return Call(request, chat, prompt_tokens=prompt_tokens,
                max_output_tokens=min(max_tokens, window - prompt_tokens) * (request.n or 1),
                adapter=adapter)


def estimated_call(config: DeploymentConfig, request: OpenAIRequest, *, chat: bool,
                   adapter: AdapterRef | None) -> Call:
    """A call on an upstream whose tokenizer does not run here: an upper estimate of the
    prompt (4 characters a token, plus per-message framing) checked against the window."""
    if adapter is not None:  # routing never sends adapters here; refuse rather than drop
        raise model_not_found(request.model)
    prompt_tokens = estimated_prompt_tokens(request, chat=chat)
    window = config.context_window
    if prompt_tokens >= window:
        raise bad_request(
            f"This model's maximum context length is {window} tokens; the prompt has "
            f"about {prompt_tokens}.", param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = request.requested_max_tokens or (window - prompt_tokens)
    return Call(request, chat, prompt_tokens=prompt_tokens,
                max_output_tokens=max_tokens * (request.n or 1))


async def prepared(deployment: Deployment, prepare: Callable[[Deployment], Call]) -> Call:
    """`prepare(deployment)`, in a worker thread where it tokenizes."""
    if deployment.tokenizes:
        return await asyncio.to_thread(prepare, deployment)
    return prepare(deployment)
