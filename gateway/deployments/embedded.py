"""The engine running inside the gateway process (the embedded default of `make serve`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from gateway.deployments.base import Call, Deployment
from gateway.deployments.config import DeploymentConfig
from gateway.errors import APIError, bad_request, unavailable
from gateway.schemas.openai import OpenAIRequest
from workers.async_engine import AsyncLLMEngine, EngineDeadError
from workers.client import EmbeddedClient, PreparedCall
from workers.engine.sampling_params import InvalidRequestError
from workers.llm_engine import EngineOverloadedError


class EmbeddedDeployment(Deployment):
    def __init__(self, config: DeploymentConfig, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine
        self.client = EmbeddedClient(engine, config.model_name)

    async def start(self) -> None:
        await self.engine.start()  # loads the model unless the engine came loaded

    async def close(self) -> None:
        await self.engine.shutdown()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str) -> Call:
        body = request.upstream_body()
        try:
            salt = None if self.config.shared_prefix_cache else tenant_id
            prepared = self.client.prepare(body, chat=chat, cache_salt=salt)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None
        return Call(request, chat, prompt_tokens=prepared.usage.prompt_tokens,
                    max_output_tokens=prepared.max_output_tokens, usage=prepared.usage,
                    native=prepared)

    async def complete(self, call: Call, *, request_id: str) -> bytes:
        native: PreparedCall = call.native
        started = time.perf_counter()
        try:
            response = await self.client.complete(native, request_id=request_id)
        except (InvalidRequestError, EngineOverloadedError, EngineDeadError) as exc:
            raise _api_error(exc) from None
        finally:
            call.upstream_s += time.perf_counter() - started
        return json.dumps(response, separators=(",", ":")).encode()

    async def open_stream(self, call: Call, *, request_id: str) -> AsyncIterator[bytes]:
        native: PreparedCall = call.native
        started = time.perf_counter()
        try:
            return await self.client.open_stream(
                native, request_id=request_id, include_usage=call.request.include_usage
            )
        except (InvalidRequestError, EngineOverloadedError, EngineDeadError) as exc:
            raise _api_error(exc) from None
        finally:
            call.upstream_s += time.perf_counter() - started


def _api_error(exc: Exception) -> APIError:
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineOverloadedError):
        return unavailable(str(exc))
    return unavailable("the model worker has failed", code="worker_failed")
