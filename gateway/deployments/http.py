"""An OpenAI-compatible HTTP upstream: a remote Switchboard worker or a provider.

The upstream key is the deployment's own, server-side; the caller's key never goes upstream.
Streams are relayed event by event as they arrive; the usage event is requested upstream so
the real token count can be reconciled, and dropped again if the caller did not ask for it.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from gateway.deployments.base import (
    AdapterRef,
    Call,
    Deployment,
    UpstreamFailure,
    estimated_call,
)
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.http_pool import HttpPool
from gateway.errors import APIError
from gateway.observability.tracing import inject_trace_headers
from gateway.schemas.openai import OpenAIRequest

PASSTHROUGH_STATUSES = (400, 413, 422)


class HttpDeployment(Deployment):
    tls: ssl.SSLContext | bool = True  # True: verify against the system's CAs

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
        return estimated_call(self.config, request, chat=chat, adapter=adapter)

    async def complete(self, call: Call, *, request_id: str) -> bytes:
        body = self._body(call, stream=False)
        started = time.perf_counter()
        try:
            async with self._post(body, call.chat, request_id) as resp:
                await check_response(resp)
                raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise upstream_failure(exc) from None
        finally:
            call.upstream_s += time.perf_counter() - started
        try:
            usage = json.loads(raw).get("usage") or {}
        except (ValueError, AttributeError):
            raise UpstreamFailure(502, "upstream sent an invalid JSON response") from None
        call.take_usage(usage)
        call.usage.finished = True
        return raw

    async def open_stream(self, call: Call, *, request_id: str) -> AsyncIterator[bytes]:
        body = self._body(call, stream=True)
        started = time.perf_counter()
        ctx = self._post(body, call.chat, request_id)
        try:
            resp = await ctx.__aenter__()
            try:
                await check_response(resp)
            except BaseException:
                resp.release()
                raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise upstream_failure(exc) from None
        finally:
            call.upstream_s += time.perf_counter() - started
        return self._relay(resp, call)

    async def _relay(self, resp: aiohttp.ClientResponse, call: Call) -> AsyncIterator[bytes]:
        """Pass events on as they come; closing this early closes the upstream connection."""
        want_usage = call.request.include_usage
        content_events = 0
        saw_usage = False
        event: list[bytes] = []
        sent = False
        try:
            async for line in resp.content:
                if line.strip():
                    event.append(line)
                    continue
                if not event:
                    continue
                data = b"".join(event)
                event = []
                usage, has_choices = _usage_of(data) if b'"usage"' in data else ({}, True)
                if usage:  # any JSON spelling: `"usage": {` from Python's json.dumps too
                    call.take_usage(usage)
                    saw_usage = True
                    if not want_usage and not has_choices:
                        continue
                elif data.startswith(b"data: [DONE]"):
                    call.usage.finished = True
                else:
                    content_events += 1
                    if not saw_usage:  # until the upstream says, count one token per event
                        call.usage.completion_tokens = content_events
                sent = True
                yield data + b"\n"
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = upstream_failure(exc)
            if not sent:
                raise failure from None  # nothing reached the client: the router may retry
            # Events are out, so no retry: end with an error event the client can see. The
            # usage so far is billed.
            yield error_event(failure.message, failure.code)
        finally:
            resp.close()

    def upstream_fields(self, call: Call) -> dict[str, Any]:
        """What this upstream is told besides the caller's fields: the model it serves."""
        return {"model": self.config.upstream_model or self.config.model_name}

    def _body(self, call: Call, *, stream: bool) -> bytes:
        body: dict[str, Any] = call.request.upstream_body()
        body.update(self.upstream_fields(call))
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        else:
            body.pop("stream_options", None)
        return json.dumps(body, separators=(",", ":")).encode()

    def _post(self, body: bytes, chat: bool, request_id: str) -> Any:
        headers = {**self._headers, "x-request-id": request_id}
        inject_trace_headers(headers)  # the dispatch span continues on the worker
        return self._pool.session.post(
            self._urls[chat], data=body, headers=headers, timeout=self._timeout, ssl=self.tls
        )


async def check_response(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 300:
        return
    raw = await resp.read()
    message, code = _upstream_error(raw)
    message = message or f"upstream returned HTTP {resp.status}"
    if resp.status in PASSTHROUGH_STATUSES:
        # A prompt too long for this upstream keeps its code: the router then tries a
        # deployment with a larger context window.
        keep = code if code == "context_length_exceeded" else "upstream_rejected"
        raise APIError(resp.status, message, code=keep)
    if resp.status == 429:
        raise UpstreamFailure(429, "the upstream is rate limiting; retry later",
                              code="upstream_rate_limited",
                              retry_after=resp.headers.get("retry-after"))
    if resp.status in (401, 403):
        raise UpstreamFailure(502, "the upstream refused the gateway's credentials")
    raise UpstreamFailure(502, f"upstream error (HTTP {resp.status})")


def error_event(message: str, code: str) -> bytes:
    """An SSE event in OpenAI's error shape, for failures after the stream has started."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def upstream_failure(exc: BaseException) -> UpstreamFailure:
    if isinstance(exc, TimeoutError):
        return UpstreamFailure(504, "the upstream timed out", code="upstream_timeout")
    return UpstreamFailure(502, "could not reach the upstream", code="upstream_unreachable")


def _upstream_error(raw: bytes) -> tuple[str | None, str | None]:
    """The message and code of an upstream error in OpenAI's shape."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    message = error.get("message")
    code = error.get("code")
    return (message[:2000] if isinstance(message, str) else None,
            code if isinstance(code, str) else None)


def _usage_of(data: bytes) -> tuple[dict[str, Any], bool]:
    try:
        obj = json.loads(data[len(b"data:"):])
    except ValueError:
        return {}, True
    if not isinstance(obj, dict):
        return {}, True
    usage = obj.get("usage")
    return (usage if isinstance(usage, dict) else {}), bool(obj.get("choices"))
