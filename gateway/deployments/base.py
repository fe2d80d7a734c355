"""What every deployment offers the request path: prepare, complete, stream."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway.deployments.config import DeploymentConfig
from gateway.schemas.openai import OpenAIRequest
from workers.client import Usage


class UpstreamFailure(Exception):
    """The deployment could not serve the call (connection, timeout, 5xx, upstream 429).

    Fallbacks (a later layer) retry these on the next deployment; today they become 502/504/429.
    """

    def __init__(self, status: int, message: str, *, code: str = "upstream_error",
                 retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after


@dataclass
class Call:
    """One validated call on one deployment, with the numbers admission needs."""

    request: OpenAIRequest
    chat: bool
    prompt_tokens: int  # exact for the embedded engine, an upper estimate for HTTP upstreams
    max_output_tokens: int
    usage: Usage = field(default_factory=Usage)
    native: Any = None  # the deployment's own prepared form
    upstream_s: float = 0.0  # time spent waiting on the upstream (for x-gateway-overhead-ms)


class Deployment(ABC):
    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config

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

    @abstractmethod
    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str) -> Call:
        """Validate and count tokens; raise APIError(400) for what this deployment refuses.

        `tenant_id` scopes anything shared between requests (the engine's prefix cache)."""

    @abstractmethod
    async def complete(self, call: Call, *, request_id: str) -> bytes:
        """The whole JSON response body; fills call.usage."""

    @abstractmethod
    async def open_stream(self, call: Call, *, request_id: str) -> AsyncIterator[bytes]:
        """SSE event bytes. Failures before the first event raise here, not in the iterator."""
