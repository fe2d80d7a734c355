"""An OpenAI-compatible HTTP upstream: a remote Switchboard worker or a provider.

The upstream key is the deployment's own, server-side; the caller's key never goes upstream.
Answers are read into typed events once, as they arrive (JSON or SSE); a stream asks for the
usage event upstream so the real token count can be reconciled (the gateway renders it to the
caller only if asked).

A Responses or Messages request goes to `{base_url}/responses` or `{base_url}/messages` as it
is where the config's `native_apis` says the upstream serves that API (`native_events`, shared
with litellm providers; `gateway.deployments.native` reads the answer); any other request, and
every request to a worker, is sent to chat (or text) completions.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Mapping
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
from gateway.deployments.native import (
    ANTHROPIC_VERSION,
    PATHS,
    VERSION_HEADER,
    Native,
    native_of,
    reader,
)
from gateway.errors import APIError
from gateway.observability.tracing import inject_trace_headers
from workers.protocol.events import Event, Failed
from workers.protocol.render import events_of_chunk, events_of_response, opened_of
from workers.protocol.requests import OpenAIRequest
from workers.protocol.wire_json import dumps, loads

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
        # The native APIs it serves: their URL and headers (`native_headers`).
        self._native = {api: (f"{base}{PATHS[api]}", native_headers(api, self._headers, secret))
                        for api in config.native()}
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self.streams_whole = self.streams_whole or config.stream_whole_answers

    def prepare(self, request: OpenAIRequest, *, chat: bool, tenant_id: str,
                adapter: AdapterRef | None = None) -> Call:
        return estimated_call(self.config, request, chat=chat, adapter=adapter)

    # Ask for a stream even for a whole answer (then folded): an upstream shows progress only
    # while streaming, and the first event ends the routing deadline.
    streams_whole = False

    def open(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
        """Natively where the upstream speaks the call's surface, else as chat."""
        native = native_of(call.request, self._native)
        if native is not None:
            url, headers = self._native[native.api]
            stream = bool(call.request.stream) or self.streams_whole
            body = native.upstream_body(self.upstream_fields(call)["model"], stream=stream)
            asked = native.upstream_headers(headers)
            return native_events(lambda: self._pool.session.post(
                url, data=body, headers=traced(asked, request_id), timeout=self._timeout,
                ssl=self.tls), native, call, stream=stream)
        return self._chat(call, request_id=request_id)

    async def _chat(self, call: Call, *, request_id: str) -> AsyncIterator[Event]:
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
        return dumps(body)

    def _post(self, body: bytes, chat: bool, request_id: str) -> Any:
        return self._pool.session.post(self._urls[chat], data=body,
                                       headers=traced(self._headers, request_id),
                                       timeout=self._timeout, ssl=self.tls)


def native_headers(api: str, headers: Mapping[str, str], secret: str | None
                   ) -> dict[str, str]:
    """An OpenAI-compatible server's headers for a native API: on /messages also Anthropic's
    `anthropic-version` (the client's replaces it per call, and its `anthropic-beta` is
    added: `Native.upstream_headers`), and the key as `x-api-key` too (servers that speak
    Messages beside chat take one or the other)."""
    out = dict(headers)
    if api == "messages":
        out[VERSION_HEADER] = ANTHROPIC_VERSION
        if secret:
            out["x-api-key"] = secret
    return out


def traced(headers: Mapping[str, str], request_id: str) -> dict[str, str]:
    """`headers` with the request's id and trace (the dispatch span continues upstream)."""
    out = {**headers, "x-request-id": request_id}
    inject_trace_headers(out)
    return out


async def native_events(post: Callable[[], Any], native: Native, call: Call, *, stream: bool
                        ) -> AsyncIterator[Event]:
    """The answer of a native API call (`post()` sends it) read into events as it arrives, as
    `HttpDeployment._chat` reads chat's: a failure before the first event raises (the router
    may try elsewhere), after it ends the answer with `Failed`; closing this early closes the
    upstream connection."""
    usage = call.usage
    read = reader(native.api)
    sent = False
    try:
        async with post() as resp:
            await check_response(resp)
            if not stream:
                for event in read.whole(_json_object(await resp.read())):
                    usage.observe(event)
                    sent = True
                    yield event
                usage.finished = read.finished
                return
            lines: list[bytes] = []
            async for line in resp.content:
                if line.strip():
                    lines.append(line)
                    continue
                chunk = _chunk_of(lines)
                lines = []
                if chunk is None or chunk is _DONE:
                    continue
                if not isinstance(chunk, dict):
                    yield Failed(502, "upstream sent an invalid event", "upstream_error")
                    return
                for event in read.feed(chunk):
                    usage.observe(event)
                    sent = True
                    yield event
                    if isinstance(event, Failed):
                        return
                if read.finished:
                    usage.finished = True
                    return
            yield Failed(502, "the upstream ended the stream early", "upstream_error")
    except (TimeoutError, aiohttp.ClientError) as exc:
        failure = upstream_failure(exc)
        if not sent:
            raise failure from None
        yield failed(failure)


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
    """The message and code of an upstream error in OpenAI's (or Anthropic's) shape.
    Anthropic says a prompt is too long only in words: that is `context_length_exceeded`."""
    try:
        error = loads(raw).get("error")
    except (ValueError, AttributeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    message = error.get("message")
    code = error.get("code")
    if code is None and isinstance(message, str) and message.startswith("prompt is too long"):
        code = "context_length_exceeded"
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
        return loads(payload)
    except ValueError:
        return payload


def _response_events(raw: bytes, call: Call) -> list[Event]:
    return events_of_response(_json_object(raw), chat=call.chat)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        response = loads(raw)
    except ValueError:
        response = None
    if not isinstance(response, dict):
        raise UpstreamFailure(502, "upstream sent an invalid JSON response")
    return response
