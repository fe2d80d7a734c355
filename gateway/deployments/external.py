"""Any provider litellm knows (OpenAI, Anthropic, Bedrock, Vertex, ...), through litellm as a
library.

litellm only translates one call to the provider's API and back: the gateway keeps its own
auth, limits, routing, retries and billing. So litellm's retries, fallbacks, callbacks and
telemetry are off, and its errors become the same UpstreamFailure / APIError the direct HTTP
deployment raises, for the router to retry or fall back on.

The upstream key and base URL are the deployment's, server-side. The call's keyword arguments
are built from an allow-list of sampling fields, so nothing in a request body can reach
litellm's api_base, api_key, extra_headers or mock_response arguments; and no message the
client sees carries the key or the base URL.

Where the provider speaks the call's surface natively (`DeploymentConfig.native`: Anthropic's
Messages, OpenAI's Responses at its own endpoint), the surface's body goes to the provider's
endpoint as it is. litellm says where and how (its provider config's URL and auth headers, found
once at start; a Messages call adds the client's `anthropic-version` and `anthropic-beta`, as
the surface validated them: `Native.upstream_headers`), and the gateway's pooled HTTP client
sends it and reads the answer
(`gateway.deployments.http.native_events`): litellm 1.106's own streaming Messages call
imports its proxy server (`litellm[proxy]`: orjson, soundfile, backoff, ...), which the gateway
does not install. Native APIs the config asks for and litellm cannot set up (a provider whose
requests it signs per call, such as Bedrock; no key) are refused at start; a provider's default
that cannot be set up is logged and translated to chat instead.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import re
import threading
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from gateway.deployments.base import (
    AdapterRef,
    Call,
    Deployment,
    UpstreamFailure,
    estimated_call,
    failed,
)
from gateway.deployments.config import DeploymentConfig, NativeApi, Price
from gateway.deployments.http import native_events, traced
from gateway.deployments.http_pool import HttpPool
from gateway.deployments.native import native_of
from gateway.errors import APIError, bad_request
from workers.protocol.events import Event, Failed
from workers.protocol.render import events_of_chunk, events_of_response, opened_of
from workers.protocol.requests import OpenAIRequest

logger = logging.getLogger(__name__)

PASSTHROUGH_STATUSES = (400, 413, 422)
CONTEXT_CODE = "context_length_exceeded"
# What a request may set on the litellm call: sampling only, never where or how it connects.
_SAMPLING = frozenset({
    "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
    "frequency_penalty", "user", "top_k", "min_p", "repetition_penalty", "min_tokens",
    "ignore_eos", "logprobs",
})
CHAT_FIELDS = _SAMPLING | {
    "messages", "max_completion_tokens", "top_logprobs", "logit_bias", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "functions", "function_call", "audio",
    "modalities", "prediction", "reasoning_effort", "verbosity", "web_search_options",
    "service_tier", "store", "prompt_cache_key", "safety_identifier",
}
TEXT_FIELDS = _SAMPLING | {"prompt", "logit_bias", "best_of", "echo", "suffix"}
# Known fields litellm would keep for itself or not pass on: sent in the body as they are.
EXTRA_BODY_FIELDS = frozenset({
    "metadata", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structured_outputs",
})
# "litellm.BadRequestError: OpenAIException - the upstream's own words"
_PREFIXES = re.compile(r"^(?:litellm\.\w+:\s*)*(?:\w+(?:Error|Exception)(?::|\s+-)\s*)*")
_RETRY_AFTER = re.compile(r"^[\w ,:+-]{1,64}$")  # seconds or an HTTP date; nothing to inject

_litellm: ModuleType | None = None
_import_lock = threading.Lock()


def load_litellm() -> ModuleType:
    """litellm, imported once (seconds: start() runs this off the event loop) and quiet.

    The local cost map is forced first, or the import fetches it over the network."""
    global _litellm
    if _litellm is not None:
        return _litellm
    with _import_lock:
        if _litellm is None:
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            import litellm
            import openai.resources  # noqa: F401 - else the first call imports it on the loop

            litellm.suppress_debug_info = True
            litellm.set_verbose = False
            litellm.telemetry = False  # gone in recent releases; harmless where it is
            litellm.turn_off_message_logging = True
            litellm.disable_streaming_logging = True  # per-chunk logging work for no callback
            litellm.num_retries = None
            litellm.callbacks = []
            litellm.success_callback = []
            litellm.failure_callback = []
            # Its loggers print to stderr on their own handler; the gateway maps and logs what
            # matters (e.g. its logging worker warns each time a test opens a new event loop).
            for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
                logging.getLogger(name).setLevel(logging.ERROR)
            _litellm = litellm
    return _litellm


class LiteLLMDeployment(Deployment):
    """A deployment whose `upstream_model` is a litellm model string ("openai/gpt-4o-mini")."""

    _live = 0  # started and not closed, over all instances: litellm's client cache is global

    def __init__(self, config: DeploymentConfig, pool: HttpPool | None = None) -> None:
        super().__init__(config)
        self._api_key = config.secret()
        self._redact = _secrets_of(config.base_url, self._api_key)
        self._started = False
        self._cataloged = True  # in litellm's catalog (known at start)
        self._pool = pool  # sends native calls
        self._model = ""  # the provider's own name of the model (set at start)
        self._native: dict[NativeApi, tuple[str, dict[str, str]]] = {}  # URL, headers
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)

    async def start(self) -> None:
        """Import litellm off the loop, check the model string, find the endpoints of the
        APIs its provider speaks natively, price it from the cost map."""
        litellm = await asyncio.to_thread(load_litellm)
        model = self.config.upstream_model or ""
        try:
            self._model, provider, _, _ = litellm.get_llm_provider(
                model=model, api_base=self.config.base_url)
        except Exception:
            raise bad_request(f"litellm does not know which provider serves {model!r}; use "
                              "'provider/model', e.g. 'openai/gpt-4o-mini'.",
                              param="upstream_model", code="invalid_value") from None
        self._native = {}
        for api in sorted(self.config.native(provider)):
            try:
                if self._pool is None:
                    raise bad_request("native APIs need the gateway's HTTP pool",
                                      param="native_apis")
                self._native[api] = native_endpoint(litellm, api, self._model, provider,
                                                    base_url=self.config.base_url,
                                                    api_key=self._api_key)
            except APIError as exc:
                if self.config.native_apis is not None:  # asked for: refused
                    raise
                logger.warning("deployment %s: %s requests are translated to chat (%s)",
                               self.name, api, self._scrubbed(exc.message))
        self._cataloged = _cataloged(litellm, model)
        if self.config.configured_price() is None:
            self.price = cost_map_price(litellm, model)
            if self.price.source == "none":
                logger.warning("deployment %s: litellm's cost map has no price for %r; it is "
                               "served free unless the config sets input_price_per_1m and "
                               "output_price_per_1m", self.name, model)
        if not self._started:
            self._started = True
            LiteLLMDeployment._live += 1

    async def close(self) -> None:
        """The last one closed closes litellm's cached HTTP clients (else their connections
        outlive the app); an edit starts the new deployment before closing the old one."""
        if not self._started:
            return
        self._started = False
        LiteLLMDeployment._live -= 1
        if LiteLLMDeployment._live == 0:
            await _close_litellm_clients()

    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                adapter: AdapterRef | None = None) -> Call:
        return estimated_call(self.config, request, chat=chat, adapter=adapter)

    def open(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
        """Natively where the provider speaks the call's surface, else through litellm."""
        native = native_of(call.request, self._native) if self._pool is not None else None
        if native is not None:
            url, headers = self._native[native.api]
            stream = bool(call.request.stream)
            pool, body = self._pool, native.upstream_body(self._model, stream=stream)
            asked = native.upstream_headers(headers)
            return native_events(lambda: pool.session.post(
                url, data=body, headers=traced(asked, request_id), timeout=self._timeout),
                native, call, stream=stream)
        return self._translated(call, request_id=request_id)

    async def _translated(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
        """Waits for the provider's answer (or a stream's first chunk), so a failure before it
        raises (and the router can still fall back); later failures end with `Failed`."""
        litellm = load_litellm()
        send = litellm.acompletion if call.chat else litellm.atext_completion
        deadline = asyncio.get_running_loop().time() + self.config.timeout_s
        if not call.request.stream:
            try:
                async with asyncio.timeout_at(deadline):
                    response = await send(**self._kwargs(call, stream=False,
                                                         request_id=request_id))
            except Exception as exc:
                raise self._failure(exc, call) from None
            data = _tidy(_dump(response))
            data["model"] = call.request.model  # the name the client asked for
            for event in events_of_response(data, chat=call.chat):
                call.usage.observe(event)
                yield event
            call.usage.finished = True
            return
        stream: Any = None
        try:
            async with asyncio.timeout_at(deadline):
                stream = await send(**self._kwargs(call, stream=True, request_id=request_id))
                first = await _next(stream)
        except Exception as exc:
            if stream is not None:
                await _close_upstream(stream)
            raise self._failure(exc, call) from None
        except BaseException:  # cancelled: the client left before the first chunk
            if stream is not None:
                await _close_upstream(stream)
            raise
        async for event in self._relay(stream, first, call, deadline):
            yield event

    async def _relay(self, stream: Any, first: Any, call: Call, deadline: float
                     ) -> AsyncIterator[Event]:
        """Chunks as events, as they come; closing this early closes the upstream stream."""
        chunk = first
        opened = False
        try:
            while chunk is not None:
                data = _dump(chunk)
                if _finishes(data) and _upstream_finished(stream) is False:
                    break  # litellm's own "stop" for a stream the provider never finished
                data = _tidy(data)
                data["model"] = call.request.model
                if not opened:
                    opened = True
                    yield opened_of(data)
                for event in events_of_chunk(data, chat=call.chat):
                    call.usage.observe(event)
                    yield event
                async with asyncio.timeout_at(deadline):
                    chunk = await _next(stream)
            if _upstream_finished(stream) is False:
                logger.warning("deployment %s: the stream ended unfinished", self.name)
                yield Failed(502, "the upstream ended the stream early", "upstream_error")
                return
            call.usage.finished = True
        except Exception as exc:  # the client has had bytes: end here, bill the usage so far
            logger.warning("deployment %s: the stream failed midway (%s)", self.name,
                           type(exc).__name__)
            failure = self._failure(exc, call)
            yield failed(failure) if isinstance(failure, APIError | UpstreamFailure) else \
                Failed(502, "upstream error", "upstream_error")
        finally:
            await _close_upstream(stream)

    def _kwargs(self, call: Call, *, stream: bool, request_id: str) -> dict[str, Any]:
        allowed = CHAT_FIELDS if call.chat else TEXT_FIELDS
        # A deep copy: litellm may edit messages in place, and the body is shared with the
        # cache key and any later attempt.
        body = copy.deepcopy(call.request.upstream_body())
        kwargs = {k: v for k, v in body.items() if k in allowed}
        # Vendor extras (routing admitted only those in passthrough_fields) and the known
        # fields litellm would swallow go in the request body, never as litellm arguments.
        extra = {k: v for k, v in body.items()
                 if k in EXTRA_BODY_FIELDS or k in call.request.extra_fields()}
        if not self._cataloged and "user" in kwargs:
            # litellm passes `user` on only for models its catalog knows; to any other it
            # would be dropped, so it goes in the body as sent.
            extra["user"] = kwargs.pop("user")
        if extra:
            kwargs["extra_body"] = extra
        kwargs.update(
            model=self.config.upstream_model, stream=stream, timeout=self.config.timeout_s,
            num_retries=0, max_retries=0, extra_headers={"x-request-id": request_id},
            # Only function tools pass the schema; litellm's MCP gateway would import `mcp`
            # (not installed) for any call with tools, and has nothing to do here.
            _skip_mcp_handler=True,
        )
        if stream:
            kwargs["stream_options"] = {"include_usage": True}  # to settle the real usage
        if self.config.base_url:
            kwargs["api_base"] = self.config.base_url
        if self._api_key:
            kwargs["api_key"] = self._api_key
        return kwargs

    def _failure(self, exc: BaseException, call: Call) -> Exception:
        """litellm's exception as the HTTP deployment would have reported the same upstream."""
        if isinstance(exc, APIError | UpstreamFailure):
            return exc
        if _timed_out(exc):
            return UpstreamFailure(504, "the upstream timed out", code="upstream_timeout")
        if _unreachable(exc):
            return UpstreamFailure(502, "could not reach the upstream",
                                   code="upstream_unreachable")
        status = getattr(exc, "status_code", None)
        status = status if isinstance(status, int) else None
        if _context_exceeded(exc, status):
            message = self._message(exc) or "The prompt is longer than the model's context."
            return bad_request(message, param="messages" if call.chat else "prompt",
                               code=CONTEXT_CODE)
        if status == 429:
            return UpstreamFailure(429, "the upstream is rate limiting; retry later",
                                   code="upstream_rate_limited", retry_after=_retry_after(exc))
        if status in (401, 403):
            return UpstreamFailure(502, "the upstream refused the gateway's credentials")
        if status in PASSTHROUGH_STATUSES:
            message = self._message(exc) or f"upstream returned HTTP {status}"
            return APIError(status, message, code="upstream_rejected")
        if status is not None and status >= 300:
            return UpstreamFailure(502, f"upstream error (HTTP {status})")
        logger.warning("deployment %s: litellm failed with %s", self.name, type(exc).__name__)
        return UpstreamFailure(502, "upstream error")

    def _message(self, exc: BaseException) -> str | None:
        """The upstream's own words, without litellm's prefixes, the key or the base URL."""
        body = getattr(exc, "body", None)
        text = body.get("message") if isinstance(body, dict) else None
        if not isinstance(text, str) or not text:
            raw = getattr(exc, "message", None)
            text = _PREFIXES.sub("", raw if isinstance(raw, str) else str(exc))
        return self._scrubbed(text).strip()[:2000] or None

    def _scrubbed(self, text: str) -> str:
        for secret in self._redact:
            text = text.replace(secret, "[redacted]")
        return text


def native_endpoint(litellm: ModuleType, api: NativeApi, model: str, provider: str, *,
                    base_url: str | None, api_key: str | None) -> tuple[str, dict[str, str]]:
    """Where and with which headers (auth, `anthropic-version`) the provider takes `api`, as
    litellm's provider config says; a 400 naming `native_apis` where litellm has none for the
    provider, or signs its requests per call."""
    from litellm.llms.base_llm.anthropic_messages.transformation import (
        BaseAnthropicMessagesConfig,
    )
    from litellm.types.router import GenericLiteLLMParams
    from litellm.utils import ProviderConfigManager

    def refused(why: str) -> APIError:
        return bad_request(f"litellm's provider {provider!r} cannot be sent {api} natively "
                           f"({why}); leave it out of native_apis", param="native_apis")

    try:
        if api == "messages":
            config = ProviderConfigManager.get_provider_anthropic_messages_config(
                model=model, provider=litellm.LlmProviders(provider))
            if config is None:
                raise refused("litellm has no Messages config for it")
            if type(config).sign_request is not BaseAnthropicMessagesConfig.sign_request:
                raise refused("litellm signs its requests per call")
            url = config.get_complete_url(api_base=base_url, api_key=api_key, model=model,
                                          optional_params={}, litellm_params={})
            headers, _ = config.validate_anthropic_messages_environment(
                headers={}, model=model, messages=[], optional_params={}, litellm_params={},
                api_key=api_key, api_base=base_url)
        else:
            responses = ProviderConfigManager.get_provider_responses_api_config(
                provider=provider, model=model)
            if responses is None:
                raise refused("litellm has no Responses config for it")
            params = GenericLiteLLMParams(api_key=api_key, api_base=base_url)
            url = responses.get_complete_url(api_base=base_url, litellm_params=dict(params))
            headers = responses.validate_environment(headers={}, model=model,
                                                     litellm_params=params)
    except APIError:
        raise
    except Exception as exc:  # litellm's own complaint (no key, an unknown provider)
        raise refused(_PREFIXES.sub("", str(exc))[:300]) from None
    return url, {str(k).lower(): str(v) for k, v in headers.items()}


async def _close_litellm_clients() -> None:
    litellm = load_litellm()
    try:
        from litellm.llms.custom_httpx.async_client_cleanup import close_litellm_async_clients

        await close_litellm_async_clients()
        litellm.in_memory_llm_clients_cache.flush_cache()
    except Exception as exc:  # best effort: an internal API of litellm's
        logger.debug("closing litellm's clients failed: %r", exc)


def _cataloged(litellm: ModuleType, model: str) -> bool:
    try:
        litellm.get_model_info(model=model)
    except Exception:
        return False
    return True


def cost_map_price(litellm: ModuleType, model: str) -> Price:
    """USD per 1M tokens from litellm's local cost map, exactly (Decimal of the printed float);
    Price(source="none") for a model the map lacks."""
    try:
        info = litellm.get_model_info(model=model)
    except Exception:
        return Price(source="none")
    inp, out = info.get("input_cost_per_token"), info.get("output_cost_per_token")
    if inp is None and out is None:
        return Price(source="none")
    cached = info.get("cache_read_input_token_cost")
    return Price(_per_1m(inp), _per_1m(out), None if cached is None else _per_1m(cached),
                 source="litellm")


def _per_1m(per_token: Any) -> Decimal:
    if per_token is None:
        return Decimal(0)
    return Decimal(str(per_token)) * 1_000_000


def _secrets_of(base_url: str | None, api_key: str | None) -> tuple[str, ...]:
    found = [api_key or ""]
    if base_url:
        parts = urlsplit(base_url)
        found += [base_url, base_url.rstrip("/"), parts.netloc, parts.hostname or ""]
    # Longest first, so a URL is replaced whole before its host is.
    return tuple(sorted({s for s in found if len(s) >= 4}, key=len, reverse=True))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _timed_out(exc: BaseException) -> bool:
    import httpx
    import openai

    return any(isinstance(e, TimeoutError | openai.APITimeoutError | httpx.TimeoutException)
               for e in _chain(exc))


def _unreachable(exc: BaseException) -> bool:
    """litellm 1.106 reports a refused connection as an InternalServerError("Connection
    error."); what it wraps tells it from a real 500."""
    import httpx
    import openai

    return any(isinstance(e, openai.APIConnectionError | httpx.ConnectError
                          | httpx.NetworkError | ConnectionError) for e in _chain(exc))


def _context_exceeded(exc: BaseException, status: int | None) -> bool:
    litellm = load_litellm()
    if isinstance(exc, litellm.ContextWindowExceededError):
        return True
    if status != 400:
        return False
    body = getattr(exc, "body", None)
    code = getattr(exc, "code", None) or (body.get("code") if isinstance(body, dict) else None)
    return code == CONTEXT_CODE


def _retry_after(exc: BaseException) -> str | None:
    for e in _chain(exc):
        response = getattr(e, "response", None)
        for headers in (getattr(e, "litellm_response_headers", None),
                        getattr(e, "headers", None), getattr(response, "headers", None)):
            value = _header(headers, "retry-after")
            if value is not None:
                return value
    return None


def _header(headers: Any, name: str) -> str | None:
    if headers is None or not hasattr(headers, "items"):
        return None
    try:
        for key, value in headers.items():
            if isinstance(key, str) and key.lower() == name and isinstance(value, str):
                value = value.strip()
                return value if _RETRY_AFTER.match(value) else None
    except Exception:
        return None
    return None


async def _next(stream: Any) -> Any:
    """The next chunk, or None at the end."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return None


async def _close_upstream(stream: Any) -> None:
    """Close the provider's stream (litellm's text wrapper has no aclose; its inner one does)."""
    for _ in range(3):
        if stream is None:
            return
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception as exc:
                logger.debug("closing the upstream stream failed: %r", exc)
            return
        stream = getattr(stream, "completion_stream", None)


def _upstream_finished(stream: Any) -> bool | None:
    """Whether the provider itself said the stream was done (None: cannot tell).

    litellm 1.106 closes a stream that just stops (no finish_reason, no [DONE]) with a
    finish_reason "stop" and a usage chunk of its own making, so the chunks cannot tell a cut
    stream from a finished one; its stream wrapper remembers what the provider sent."""
    for wrapper in (stream, getattr(stream, "completion_stream", None)):
        if wrapper is not None and hasattr(wrapper, "received_finish_reason"):
            return bool(wrapper.received_finish_reason
                        or getattr(wrapper, "intermittent_finish_reason", None))
    return None


def _finishes(data: dict[str, Any]) -> bool:
    return any(isinstance(c, dict) and c.get("finish_reason") is not None
               for c in data.get("choices") or [])


def _dump(obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        return dict(obj)
    return obj.model_dump()


def _tidy(data: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's shape: without litellm's own fields and the nulls it pads messages with."""
    data.pop("provider_specific_fields", None)
    for key in ("citations", "moderation"):
        if data.get(key) is None:
            data.pop(key, None)
    for choice in data.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        choice.pop("provider_specific_fields", None)
        if "text" in choice:
            if choice["text"] is None:
                choice["text"] = ""
            if choice.get("reasoning_content") is None:
                choice.pop("reasoning_content", None)
        for part, keep in (("message", {"content", "role"}), ("delta", set())):
            inner = choice.get(part)
            if isinstance(inner, dict):
                inner.pop("provider_specific_fields", None)
                for key in [k for k, v in inner.items() if v is None and k not in keep]:
                    del inner[key]
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("tool_calls"), list):
            delta["tool_calls"] = [_tool_call_delta(c) for c in delta["tool_calls"]]
    return data


def _tool_call_delta(call: Any) -> Any:
    """A streamed tool call as OpenAI sends it: id, type and name only in a call's first
    delta (litellm repeats `type` and pads the rest with nulls)."""
    if not isinstance(call, dict):
        return call
    call = {k: v for k, v in call.items() if v is not None}
    function = call.get("function")
    if isinstance(function, dict):
        call["function"] = {k: v for k, v in function.items() if v is not None}
    if "id" not in call:
        call.pop("type", None)
    return call
