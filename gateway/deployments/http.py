"""An OpenAI-compatible HTTP upstream: a remote Switchboard worker or a provider.

The upstream key is the deployment's own, server-side; the caller's key never goes upstream.
Answers are read into typed events once, as they arrive (JSON or SSE); a stream asks for the
usage event upstream so the real token count can be reconciled (the gateway renders it to the
caller only if asked).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from gateway.deployments.base import (
    AdapterRef,
    Call,
    Deployment,
    UpstreamFailure,
    estimated_call,
    failed,
)
from gateway.deployments.config import DeploymentConfig
from gateway.deployments.http_pool import HttpPool
from gateway.errors import APIError
from gateway.observability.tracing import inject_trace_headers
from workers.protocol.events import Event, Failed
from workers.protocol.render import events_of_chunk, events_of_response, opened_of
from workers.protocol.requests import OpenAIRequest

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
        self.streams_whole = self.streams_whole or config.stream_whole_answers

    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                adapter: AdapterRef | None = None) -> Call:
        return estimated_call(self.config, request, chat=chat, adapter=adapter)

    # Ask for a stream even for a whole answer (then folded): an upstream shows progress only
    # while streaming, and the first event ends the routing deadline.
    streams_whole = False

    async def open(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
        """The upstream's JSON or SSE read into events once, as it arrives (one generator, no
        layers: this runs per event of every stream)."""
        stream = bool(call.request.stream) or self.streams_whole
        body = self._body(call, stream=stream)
        usage = call.usage
        sent = False
        try:
            async with self._post(body, call.chat, request_id) as resp:
                await check_response(resp)
                if not stream:
                    for event in _response_events(await resp.read(), call):
                        usage.observe(event)
                        sent = True
                        yield event
                    usage.finished = True
                    return
                opened = False
                lines: list[bytes] = []
                async for line in resp.content:
                    if line.strip():
                        lines.append(line)
                        continue
                    chunk = _chunk_of(lines)
                    lines = []
                    if chunk is None:
                        continue
                    if chunk is _DONE:
                        usage.finished = True
                        return
                    if not isinstance(chunk, dict):
                        yield Failed(502, "upstream sent an invalid event", "upstream_error")
                        return
                    if not opened and "error" not in chunk:
                        opened = sent = True
                        yield opened_of(chunk)
                    for event in events_of_chunk(chunk, chat=call.chat):
                        usage.observe(event)
                        sent = True
                        yield event
                        if isinstance(event, Failed):
                            return
                yield Failed(502, "the upstream ended the stream early", "upstream_error")
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = upstream_failure(exc)
            if not sent:
                raise failure from None  # nothing reached the client: the router may retry
            yield failed(failure)  # events are out, so no retry; the usage so far is billed

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


_DONE = object()


def _chunk_of(lines: list[bytes]) -> Any:
    """One SSE event's JSON: a dict, `_DONE` for [DONE], None for an event with no data,
    anything else for data that is not a JSON object."""
    if len(lines) == 1:  # the usual event: one `data:` line
        payload = lines[0][5:].strip() if lines[0].startswith(b"data:") else b""
    else:
        payload = b"\n".join(raw[5:].strip() for raw in lines if raw.startswith(b"data:"))
    if not payload:
        return None
    if payload == b"[DONE]":
        return _DONE
    try:
        return json.loads(payload)
    except ValueError:
        return payload


def _response_events(raw: bytes, call: Call) -> list[Event]:
    try:
        response = json.loads(raw)
    except ValueError:
        response = None
    if not isinstance(response, dict):
        raise UpstreamFailure(502, "upstream sent an invalid JSON response")
    return events_of_response(response, chat=call.chat)
