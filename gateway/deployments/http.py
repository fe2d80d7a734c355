"""An OpenAI-compatible HTTP upstream: a remote Switchboard worker or a provider.

The upstream key is the deployment's own, server-side; the caller's key never goes upstream.
Streams are relayed event by event as they arrive; the usage event is requested upstream so
the real token count can be reconciled, and dropped again if the caller did not ask for it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from gateway.deployments.base import AdapterRef, Call, Deployment, UpstreamFailure
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.http_pool import HttpPool
from gateway.errors import APIError, bad_request, model_not_found
from gateway.schemas.openai import OpenAIRequest

PASSTHROUGH_STATUSES = (400, 413, 422)


class HttpDeployment(Deployment):
    def __init__(self, config: DeploymentConfig, pool: HttpPool) -> None:
        super().__init__(config)
        self._pool = pool
        base = (config.base_url or "").rstrip("/")
        self._urls = {True: f"{base}/chat/completions", False: f"{base}/completions"}
        self._headers = {"content-type": "application/json"}
        secret = config.secret()
        if secret:
            self._headers["authorization"] = f"Bearer {secret}"
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)

    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                adapter: AdapterRef | None = None) -> Call:
        if adapter is not None:  # resolve never routes adapters here; refuse rather than drop
            raise model_not_found(request.model)
        count = len(request.messages) if chat else 1  # type: ignore[union-attr]
        prompt_tokens = request.prompt_chars() // 4 + 4 * count + 1
        window = self.config.context_window
        if prompt_tokens >= window:
            raise bad_request(
                f"This model's maximum context length is {window} tokens; the prompt has "
                f"about {prompt_tokens}.", param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = request.requested_max_tokens or (window - prompt_tokens)
        return Call(request, chat, prompt_tokens=prompt_tokens,
                    max_output_tokens=max_tokens * (request.n or 1))

    async def complete(self, call: Call, *, request_id: str) -> bytes:
        body = self._body(call, stream=False)
        started = time.perf_counter()
        try:
            async with self._post(body, call.chat, request_id) as resp:
                await _check(resp)
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failure(exc) from None
        finally:
            call.upstream_s += time.perf_counter() - started
        try:
            usage = json.loads(raw).get("usage") or {}
        except (ValueError, AttributeError):
            raise UpstreamFailure(502, "upstream sent an invalid JSON response") from None
        _set_usage(call, usage)
        call.usage.finished = True
        return raw

    async def open_stream(self, call: Call, *, request_id: str) -> AsyncIterator[bytes]:
        body = self._body(call, stream=True)
        started = time.perf_counter()
        ctx = self._post(body, call.chat, request_id)
        try:
            resp = await ctx.__aenter__()
            try:
                await _check(resp)
            except BaseException:
                resp.release()
                raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failure(exc) from None
        finally:
            call.upstream_s += time.perf_counter() - started
        return self._relay(resp, call)

    async def _relay(self, resp: aiohttp.ClientResponse, call: Call) -> AsyncIterator[bytes]:
        """Pass events on as they come; closing this early closes the upstream connection."""
        want_usage = call.request.include_usage
        content_events = 0
        saw_usage = False
        event: list[bytes] = []
        try:
            async for line in resp.content:
                if line.strip():
                    event.append(line)
                    continue
                if not event:
                    continue
                data = b"".join(event)
                event = []
                if b'"usage":{' in data:
                    usage, has_choices = _usage_of(data)
                    _set_usage(call, usage)
                    saw_usage = True
                    if not want_usage and not has_choices:
                        continue
                elif data.startswith(b"data: [DONE]"):
                    call.usage.finished = True
                else:
                    content_events += 1
                    if not saw_usage:  # until the upstream says, count one token per event
                        call.usage.completion_tokens = content_events
                yield data + b"\n"
        except (TimeoutError, aiohttp.ClientError):
            return  # headers are sent; the stream just ends, the usage so far is billed
        finally:
            resp.close()

    def _body(self, call: Call, *, stream: bool) -> bytes:
        body: dict[str, Any] = call.request.upstream_body()
        body["model"] = self.config.upstream_model or self.config.model_name
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        else:
            body.pop("stream_options", None)
        return json.dumps(body, separators=(",", ":")).encode()

    def _post(self, body: bytes, chat: bool, request_id: str) -> Any:
        headers = {**self._headers, "x-request-id": request_id}
        return self._pool.session.post(
            self._urls[chat], data=body, headers=headers, timeout=self._timeout
        )


async def _check(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 300:
        return
    raw = await resp.read()
    message = _upstream_message(raw) or f"upstream returned HTTP {resp.status}"
    if resp.status in PASSTHROUGH_STATUSES:
        raise APIError(resp.status, message, code="upstream_rejected")
    if resp.status == 429:
        raise UpstreamFailure(429, "the upstream is rate limiting; retry later",
                              code="upstream_rate_limited",
                              retry_after=resp.headers.get("retry-after"))
    if resp.status in (401, 403):
        raise UpstreamFailure(502, "the upstream refused the gateway's credentials")
    raise UpstreamFailure(502, f"upstream error (HTTP {resp.status})")


def _failure(exc: BaseException) -> UpstreamFailure:
    if isinstance(exc, TimeoutError):
        return UpstreamFailure(504, "the upstream timed out", code="upstream_timeout")
    return UpstreamFailure(502, "could not reach the upstream", code="upstream_unreachable")


def _upstream_message(raw: bytes) -> str | None:
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:2000]
    return None


def _usage_of(data: bytes) -> tuple[dict[str, Any], bool]:
    try:
        obj = json.loads(data[len(b"data:"):])
    except ValueError:
        return {}, True
    return (obj.get("usage") or {}), bool(obj.get("choices"))


def _set_usage(call: Call, usage: dict[str, Any]) -> None:
    if not isinstance(usage, dict):
        return
    call.usage.prompt_tokens = int(usage.get("prompt_tokens") or call.usage.prompt_tokens)
    call.usage.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict):
        call.usage.cached_tokens = int(details.get("cached_tokens") or 0)
