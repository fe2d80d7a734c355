"""The engine running inside the gateway process (the embedded default of `make serve`).

With LoRA enabled it serves tenants' adapters too. Adapters are registered with the engine
lazily, on first use (or when an admin loads one), and this deployment remembers what it
registered, so a request costs no `add_lora` once its adapter is in; concurrent first requests
share one registration.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from gateway.deployments.base import (
    AdapterRef,
    Call,
    Deployment,
    UpstreamFailure,
    failed,
    rough_call,
)
from gateway.deployments.config import DeploymentConfig
from gateway.errors import APIError, bad_request, unavailable
from workers.async_engine import AsyncLLMEngine, EngineDeadError
from workers.client import EmbeddedClient, PreparedCall
from workers.engine.sampling_params import InvalidRequestError
from workers.llm_engine import EngineOverloadedError
from workers.lora.manager import AdapterBusyError, UnknownAdapterError
from workers.protocol.events import Event
from workers.protocol.requests import OpenAIRequest

logger = logging.getLogger(__name__)


class EmbeddedDeployment(Deployment):
    def __init__(self, config: DeploymentConfig, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self.engine = engine
        self.client = EmbeddedClient(engine, config.model_name,
                                     tool_call_parser=config.tool_call_parser)
        self._adapters: dict[str, str] = {}  # engine name -> adapter id it was registered as
        self._adapter_locks: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        await self.engine.start()  # loads the model unless the engine came loaded

    async def close(self) -> None:
        await self.engine.shutdown()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def tenant_tokens(self) -> dict[str, int]:
        return self.engine.tenant_tokens()

    @property
    def serves_adapters(self) -> bool:
        engine = self.engine.engine
        return engine is not None and engine.loras is not None

    async def load_adapter(self, adapter: AdapterRef, *, force: bool = False) -> None:
        name = adapter.engine_name
        if not force and self._adapters.get(name) == adapter.adapter_id:
            return
        async with self._adapter_locks.setdefault(name, asyncio.Lock()):
            registered = self._adapters.get(name)
            if registered == adapter.adapter_id and not force:
                return  # a concurrent first request registered it meanwhile
            if registered is not None and registered != adapter.adapter_id:
                # The name was deleted and registered again (say, through another replica).
                await self.engine.remove_lora(name)
                del self._adapters[name]
            await self.engine.add_lora(name, adapter.path, pinned=adapter.pinned)
            self._adapters[name] = adapter.adapter_id

    async def unload_adapter(self, engine_name: str, *, wait_s: float = 0.0) -> None:
        async with self._adapter_locks.setdefault(engine_name, asyncio.Lock()):
            await self.engine.remove_lora(engine_name, wait_s=wait_s)
            self._adapters.pop(engine_name, None)
            self._adapter_locks.pop(engine_name, None)

    def adapter_residency(self, engine_name: str) -> str | None:
        engine = self.engine.engine
        if engine is None or engine.loras is None or engine_name not in self._adapters:
            return None
        return engine.loras.tier_of(engine_name)  # a racy read across threads: only a hint

    async def adapter_tiers(self) -> dict[str, str]:
        if not self.serves_adapters:
            return {}
        return {status.name: status.tier for status in await self.engine.list_loras()}

    @property
    def tokenizes(self) -> bool:
        return True

    def estimate(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                 adapter: AdapterRef | None = None) -> Call:
        self._refuse_impossible(request, chat=chat)
        return rough_call(request, chat=chat, window=self.client.context_window,
                          adapter=adapter)

    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                adapter: AdapterRef | None = None) -> Call:
        self._refuse_impossible(request, chat=chat)
        body = request.upstream_body()
        try:
            salt = None if self.config.shared_prefix_cache else tenant_id
            prepared = self.client.prepare(
                body, chat=chat, cache_salt=salt, model=request.model,
                lora=None if adapter is None else adapter.engine_name)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None
        return Call(request, chat, prompt_tokens=prepared.usage.prompt_tokens,
                    max_output_tokens=prepared.max_output_tokens, usage=prepared.usage,
                    native=prepared, adapter=adapter)

    def _refuse_impossible(self, request: OpenAIRequest, *, chat: bool) -> None:
        """A prompt too long for the window whatever its tokens is refused before any
        tokenizer runs: no token is longer than the vocabulary's longest entry, so a prompt
        of n characters has at least n / that many tokens."""
        fewest = request.prompt_chars() // self.client.max_token_chars
        window = self.client.context_window
        if fewest >= window:
            raise bad_request(
                f"This model's maximum context length is {window} tokens; the prompt has at "
                f"least {fewest}.", param="messages" if chat else "prompt",
                code="context_length_exceeded")

    async def open(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
        native: PreparedCall = call.native
        sent = False
        try:
            await self._ensure_adapter(call)
            if call.share is not None:
                native.schedule_for(call.share.tenant, weight=call.share.weight,
                                    priority=call.share.priority)
            async for event in self.client.events(native, request_id=request_id):
                sent = True
                yield event
        except (InvalidRequestError, EngineOverloadedError, EngineDeadError) as exc:
            error = _api_error(exc, call)
            if not sent:
                raise error from None
            yield failed(error)

    async def _ensure_adapter(self, call: Call) -> None:
        """Before dispatch: the caller's adapter is registered (a no-op once it is)."""
        if call.adapter is None:
            return
        try:
            await self.load_adapter(call.adapter)
        except (InvalidRequestError, AdapterBusyError, OSError) as exc:
            # Server-side trouble (files gone, corrupt, replaced while busy): log the details,
            # which name server paths, and tell the caller only that the model is unavailable.
            logger.error("adapter %s could not be loaded from %s: %s",
                         call.adapter.engine_name, call.adapter.path, exc)
            raise unavailable(f"The model '{call.request.model}' could not be loaded; "
                              "retry later.", code="adapter_unavailable") from None


def _api_error(exc: Exception, call: Call) -> APIError | UpstreamFailure:
    if isinstance(exc, UnknownAdapterError):  # being unloaded right now
        return unavailable(f"The model '{call.request.model}' is being unloaded; retry later.",
                           code="adapter_unavailable")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineOverloadedError):  # another deployment may have room
        return UpstreamFailure(503, str(exc), code="overloaded")
    return UpstreamFailure(503, "the model worker has failed", code="worker_failed")
