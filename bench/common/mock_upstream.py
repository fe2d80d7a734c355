"""An instant OpenAI-compatible upstream on loopback, for gateway tests and benchmarks.

Run from the repository root:

    .venv/bin/python -m bench.common.mock_upstream --host 127.0.0.1 --port 9000
    .venv/bin/python -m bench.common.mock_upstream --port 0 --delay-ms 50 --fail-rate 0.1

It prints one line, ``mock upstream listening on http://HOST:PORT``, once it accepts
connections. Endpoints:

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: a fixed short reply that echoes
  the requested model, with usage; ``"stream": true`` gives SSE chunks, a usage chunk when
  ``stream_options.include_usage`` is set, then ``data: [DONE]``. ``max_tokens`` (or
  ``max_completion_tokens``) below the reply length cuts it with ``finish_reason: "length"``.
- ``POST /v1/responses`` and ``POST /v1/messages``: the same reply in OpenAI's Responses and
  Anthropic's Messages shapes, whole or as their typed SSE events, or a call of the request's
  first tool (``bench.common.mock_native``); errors on ``/v1/messages`` take Anthropic's shape.
- ``POST /v1/embeddings``: a deterministic vector per input (``dimensions`` long, else
  ``EMBEDDING_DIM``), as floats or, with ``encoding_format: "base64"``, little-endian float32
  bytes in base64; usage counts one token per 4 characters (or per token id).
- ``GET /v1/models``: the configured model names.
- Failure modes switched at runtime: ``POST /_mode`` with a :class:`MockMode` as JSON (an
  error status with optional ``retry_after``, dropped connections, streams cut after N
  events, a context window, delays); ``POST /_reset`` clears it.
- Debug: ``GET /_last_request`` (method, path, headers and body of the last API request, so a
  test can check which ``Authorization`` a gateway sent upstream), ``GET /_stats`` (counters),
  ``POST /_reset``, ``GET /health``.

``--delay-ms`` waits before answering (concurrency-limit tests), ``--chunk-delay-ms`` waits
between stream chunks (disconnect tests), ``--fail-rate`` answers that share of API requests
with a 500 in OpenAI's error shape (fallback tests), ``--require-key`` answers 401 unless the
request carries ``Authorization: Bearer <key>``.

The server is a raw asyncio HTTP/1.1 keep-alive protocol (on uvloop when installed) that
answers without awaiting anything unless a delay is configured: one core serves tens of
thousands of requests per second, so it is never the bottleneck of a gateway benchmark.
Importable: :class:`MockUpstream` holds the logic, :func:`start_server`/:func:`serve` run it,
:class:`MockServerThread` runs it in a background thread (tests), :func:`build_app` wraps the
same logic as an ASGI app (in-process tests with ``httpx.ASGITransport``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import itertools
import json
import math
import random
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from bench.common import mock_native

DEFAULT_REPLY = "Hello from the mock upstream."
DEFAULT_MODELS = ("mock-model",)
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
             *mock_native.NATIVE_PATHS)
EMBEDDING_DIM = 8
REASONS = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
    405: "Method Not Allowed", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented",
}


# ----------------------------------------------------------------------------- config and state


@dataclass(frozen=True)
class MockConfig:
    """How the mock answers; every field has a CLI flag of the same name."""

    delay_ms: float = 0.0
    chunk_delay_ms: float = 0.0
    fail_rate: float = 0.0
    seed: int | None = 0
    reply: str = DEFAULT_REPLY
    models: tuple[str, ...] = DEFAULT_MODELS
    require_key: str | None = None


@dataclass
class MockRequest:
    """One parsed HTTP request."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class MockResponse:
    """What to send back: a whole body, or SSE events (each already ``data: ...\\n\\n``)."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    events: list[bytes] | None = None
    delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    abort: bool = False  # drop the connection instead of finishing the response


@dataclass
class MockMode:
    """Failure modes a test switches at runtime (``POST /_mode`` or ``mock.mode`` in-process).

    ``status`` answers every API request with that error (e.g. 500, 503, 429 with
    ``retry_after``); ``drop`` closes the connection without an answer; ``cut_after_events``
    sends that many stream events and then drops the connection; ``context_window`` answers
    400 ``context_length_exceeded`` to prompts longer than that many tokens; ``delay_ms`` and
    ``chunk_delay_ms`` override the configured delays."""

    status: int | None = None
    retry_after: str | None = None
    drop: bool = False
    cut_after_events: int | None = None
    context_window: int | None = None
    delay_ms: float | None = None
    chunk_delay_ms: float | None = None


@dataclass
class MockStats:
    """Counters readable through ``GET /_stats``."""

    requests: int = 0
    failures: int = 0
    streams: int = 0
    by_path: dict[str, int] = field(default_factory=dict)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(message: str, type_: str, code: str | None = None) -> bytes:
    """An error in OpenAI's shape."""
    return _json({"error": {"message": message, "type": type_, "param": None, "code": code}})


def count_tokens(text: str) -> int:
    """A deterministic stand-in for a tokenizer: one token per 4 characters, at least 1."""
    return max(1, math.ceil(len(text) / 4))


def _content_text(content: Any) -> str:
    """Text of a message's content: a string or a list of ``{"type": "text"}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The prompt's text, for the prompt token count."""
    if path == "/v1/embeddings":
        return " ".join(t for t in embedding_inputs(body.get("input")) if isinstance(t, str))
    if path in mock_native.NATIVE_PATHS:
        return mock_native.prompt_text(path, body)
    if path == "/v1/chat/completions":
        messages = body.get("messages") or []
        return " ".join(_content_text(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return " ".join(p for p in prompt if isinstance(p, str))
    return prompt if isinstance(prompt, str) else ""


def embedding_inputs(value: Any) -> list[Any]:
    """An embeddings ``input`` as a list of inputs (texts or token id lists)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [value]
    return value if isinstance(value, list) else []


def mock_vector(item: Any, dim: int) -> list[float]:
    """A unit vector that depends only on the input (a text or token ids) and ``dim``."""
    seed = hashlib.sha256(json.dumps(item).encode()).digest()
    values = [(seed[i % len(seed)] - 127.5) / 127.5 + i / (10 * dim) for i in range(dim)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [struct.unpack("<f", struct.pack("<f", v / norm))[0] for v in values]


def reply_pieces(reply: str, limit: Any) -> tuple[list[str], str]:
    """The reply split into stream pieces (one "token" each), cut at ``limit`` if smaller."""
    words = reply.split(" ")
    pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < len(pieces):
        return pieces[:limit], "length"
    return pieces, "stop"


class MockUpstream:
    """The mock's behaviour, independent of the transport that carries it."""

    def __init__(self, config: MockConfig | None = None) -> None:
        self.config = config or MockConfig()
        self.stats = MockStats()
        self.last_request: dict[str, Any] | None = None
        self._rng = random.Random(self.config.seed)
        self._ids = itertools.count(1)
        self.mode = MockMode()

    def reset(self) -> None:
        """Healthy again, with fresh counters: what each test starts from."""
        self.mode = MockMode()
        self.stats = MockStats()
        self.last_request = None

    # -- dispatch

    def handle(self, req: MockRequest) -> MockResponse:
        """Answer one request (delays are carried in the response, not slept here)."""
        if req.path.startswith("/_") or req.path == "/health":
            return self._debug(req)
        if req.path == "/v1/models":
            if req.method != "GET":
                return MockResponse(405, error_body("use GET", "invalid_request_error"))
            return self._authorized(req) or self._models()
        if req.path not in API_PATHS:
            return MockResponse(404, error_body(f"no route {req.path}", "invalid_request_error"))
        if req.method != "POST":
            return MockResponse(405, error_body("use POST", "invalid_request_error"))
        return self._api(req)

    def _authorized(self, req: MockRequest) -> MockResponse | None:
        key = self.config.require_key
        if key is None or req.headers.get("authorization") == f"Bearer {key}":
            return None
        return MockResponse(401, error_body("invalid upstream key", "invalid_request_error",
                                            "invalid_api_key"))

    def _api(self, req: MockRequest) -> MockResponse:
        try:
            body = json.loads(req.body) if req.body else {}
        except (ValueError, UnicodeDecodeError):
            body = None
        self._record(req, body)
        denied = self._authorized(req)
        if denied is not None:
            return denied
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return MockResponse(400, error_body("body must be a JSON object with a model",
                                                "invalid_request_error"))
        mode = self.mode
        delay = (self.config.delay_ms if mode.delay_ms is None else mode.delay_ms) / 1000.0
        errors = mock_native.error_body if req.path == "/v1/messages" else error_body
        failed = self._failure(mode, delay, errors)
        if failed is not None:
            return failed
        if self.config.fail_rate > 0 and self._rng.random() < self.config.fail_rate:
            self.stats.failures += 1
            body_500 = errors("mock upstream failure", "server_error")
            return MockResponse(500, body_500, delay_s=delay)
        window = mode.context_window
        tokens = count_tokens(prompt_text(req.path, body))
        if window is not None and tokens > window:
            if req.path == "/v1/messages":  # Anthropic says it in words only
                return MockResponse(400, errors(f"prompt is too long: {tokens} tokens > "
                                                f"{window} maximum", "invalid_request_error"),
                                    delay_s=delay)
            return MockResponse(400, error_body(
                f"This model's maximum context length is {window} tokens.",
                "invalid_request_error", "context_length_exceeded"), delay_s=delay)
        if req.path in mock_native.NATIVE_PATHS:
            resp = self._native(req.path, body)
        elif req.path == "/v1/embeddings":
            resp = self._embeddings(body)
        else:
            resp = self._completion(req.path, body)
        resp.delay_s = delay
        if mode.chunk_delay_ms is not None:
            resp.chunk_delay_s = mode.chunk_delay_ms / 1000.0
        if mode.cut_after_events is not None and resp.events is not None:
            resp.events = resp.events[:mode.cut_after_events]
            resp.abort = True
        return resp

    def _failure(self, mode: MockMode, delay: float,
                 errors: Callable[[str, str], bytes] = error_body) -> MockResponse | None:
        if mode.drop:
            self.stats.failures += 1
            return MockResponse(0, abort=True, delay_s=delay)
        if mode.status is not None:
            self.stats.failures += 1
            headers = {"retry-after": mode.retry_after} if mode.retry_after else {}
            kind = "rate_limit_error" if mode.status == 429 else "server_error"
            return MockResponse(mode.status, errors(f"mock upstream answers {mode.status}",
                                                    kind), delay_s=delay, headers=headers)
        return None

    def _record(self, req: MockRequest, body: Any) -> None:
        self.stats.requests += 1
        self.stats.by_path[req.path] = self.stats.by_path.get(req.path, 0) + 1
        shown = body if body is not None else req.body.decode("utf-8", "replace")
        self.last_request = {"method": req.method, "path": req.path,
                             "headers": req.headers, "body": shown}

    def _debug(self, req: MockRequest) -> MockResponse:
        if req.path == "/_last_request":
            return MockResponse(200, _json(self.last_request))
        if req.path == "/_stats":
            s = self.stats
            return MockResponse(200, _json({"requests": s.requests, "failures": s.failures,
                                            "streams": s.streams, "by_path": s.by_path}))
        if req.path == "/_reset" and req.method == "POST":
            self.stats = MockStats()
            self.last_request = None
            self.mode = MockMode()
            return MockResponse(200, b'{"ok":true}')
        if req.path == "/_mode" and req.method == "POST":
            try:
                self.mode = MockMode(**json.loads(req.body or b"{}"))
            except (ValueError, TypeError) as exc:
                return MockResponse(400, error_body(str(exc), "invalid_request_error"))
            return MockResponse(200, b'{"ok":true}')
        if req.path == "/health":
            return MockResponse(200, b'{"status":"ok"}')
        return MockResponse(404, error_body(f"no route {req.path}", "invalid_request_error"))

    def _models(self) -> MockResponse:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "mock"}
                for m in self.config.models]
        return MockResponse(200, _json({"object": "list", "data": data}))

    # -- embeddings

    def _embeddings(self, body: dict[str, Any]) -> MockResponse:
        inputs = embedding_inputs(body.get("input"))
        if not inputs or any(not item for item in inputs):
            return MockResponse(400, error_body("'input' must hold non-empty inputs",
                                                "invalid_request_error"))
        dim = body.get("dimensions") or EMBEDDING_DIM
        if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= 4096:
            return MockResponse(400, error_body("bad 'dimensions'", "invalid_request_error"))
        base64_wanted = body.get("encoding_format") == "base64"
        data = []
        for index, item in enumerate(inputs):
            vector = mock_vector(item, dim)
            embedding: Any = vector
            if base64_wanted:
                embedding = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = sum(count_tokens(i) if isinstance(i, str) else len(i) for i in inputs)
        return MockResponse(200, _json({"object": "list", "data": data, "model": body["model"],
                                        "usage": {"prompt_tokens": tokens,
                                                  "total_tokens": tokens}}))

    # -- completions

    def _native(self, path: str, body: dict[str, Any]) -> MockResponse:
        """A Responses or Messages answer (`bench.common.mock_native`)."""
        limit = body.get("max_output_tokens" if path == "/v1/responses" else "max_tokens")
        pieces, finish = reply_pieces(self.config.reply, limit)
        whole, events = mock_native.answer(path, body, pieces, finish,
                                           count_tokens(prompt_text(path, body)),
                                           next(self._ids))
        if events is None:
            return MockResponse(200, _json(whole))
        self.stats.streams += 1
        return MockResponse(200, content_type="text/event-stream", events=events,
                            chunk_delay_s=self.config.chunk_delay_ms / 1000.0)

    def _completion(self, path: str, body: dict[str, Any]) -> MockResponse:
        chat = path == "/v1/chat/completions"
        limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat \
            else body.get("max_tokens")
        pieces, finish = reply_pieces(self.config.reply, limit)
        n = body.get("n", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 16 else 1
        prompt_tokens = count_tokens(prompt_text(path, body))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces) * n,
                 "total_tokens": prompt_tokens + len(pieces) * n}
        ident = f"{'chatcmpl' if chat else 'cmpl'}-mock-{next(self._ids)}"
        head = {"id": ident, "created": int(time.time()), "model": body["model"]}
        if body.get("stream") is True:
            self.stats.streams += 1
            opts = body.get("stream_options")
            with_usage = isinstance(opts, dict) and opts.get("include_usage") is True
            events = stream_events(chat, head, pieces, finish, n, usage if with_usage else None)
            return MockResponse(200, content_type="text/event-stream", events=events,
                                chunk_delay_s=self.config.chunk_delay_ms / 1000.0)
        text = "".join(pieces)
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": None, "finish_reason": finish} for i in range(n)]
            obj = {**head, "object": "chat.completion", "choices": choices, "usage": usage}
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                       for i in range(n)]
            obj = {**head, "object": "text_completion", "choices": choices, "usage": usage}
        return MockResponse(200, _json(obj))


def stream_events(chat: bool, head: dict[str, Any], pieces: list[str], finish: str, n: int,
                  usage: dict[str, int] | None) -> list[bytes]:
    """SSE events of a stream, in OpenAI's chunk shapes, ending with ``data: [DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if usage is not None else {}

    def event(choices: list[dict[str, Any]], **more: Any) -> bytes:
        return b"data: " + _json({**head, "object": obj, "choices": choices, **extra,
                                  **more}) + b"\n\n"

    def choice(i: int, piece: str | None, reason: str | None, first: bool) -> dict[str, Any]:
        if not chat:
            return {"index": i, "text": piece or "", "logprobs": None, "finish_reason": reason}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if piece is not None:
            delta["content"] = piece
        return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}

    events = []
    if chat:
        events.append(event([choice(i, None, None, True) for i in range(n)]))
    events.extend(event([choice(i, p, None, False) for i in range(n)]) for p in pieces)
    events.append(event([choice(i, None, finish, False) for i in range(n)]))
    if usage is not None:
        events.append(event([], usage=usage))
    events.append(b"data: [DONE]\n\n")
    return events


# ----------------------------------------------------------------------------- HTTP/1.1 server


class HttpError(Exception):
    """A request that cannot be parsed; answered with ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Method, path, version and lower-cased headers of a request head."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "bad request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(400, "bad header line")
        headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1].split("?", 1)[0], parts[2], headers


def parse_chunked(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a chunked body starting at ``start``: (body, end offset), or None if incomplete."""
    body = bytearray()
    pos = start
    for _ in range(MAX_BODY_BYTES):  # bounded: each round consumes one chunk
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        except ValueError as exc:
            raise HttpError(400, "bad chunk size") from exc
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)  # no trailers expected: "0\r\n\r\n"
            return (bytes(body), end + 4) if end >= 0 else None
        if len(body) + size > MAX_BODY_BYTES:
            raise HttpError(413, "body too large")
        if len(buf) < eol + 2 + size + 2:
            return None
        body += buf[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2
    raise HttpError(400, "too many chunks")


def encode_head(status: int, content_type: str, length: int | None, close: bool,
                headers: dict[str, str] | None = None) -> bytes:
    """Status line and headers; ``length=None`` means a chunked body."""
    framing = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
    extra = "cache-control: no-cache\r\n" if content_type == "text/event-stream" else ""
    extra += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    conn = "connection: close\r\n" if close else ""
    return (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\ncontent-type: {content_type}"
            f"\r\n{framing}\r\n{extra}{conn}\r\n").encode()


def encode_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class MockProtocol(asyncio.Protocol):
    """One keep-alive connection: requests answered in order, synchronously when instant."""

    def __init__(self, mock: MockUpstream) -> None:
        self.mock = mock
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.pending: collections.deque[tuple[MockRequest | MockResponse, bool]] = (
            collections.deque())
        self.task: asyncio.Task[None] | None = None
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            for _ in range(len(self.buf) + 1):  # bounded: each round consumes one request
                parsed = None if self.closing else self._next_request()
                if parsed is None:
                    break
                self.pending.append(parsed)
        except HttpError as exc:  # answer the requests before it, then this error, then close
            self.closing = True
            self.pending.append((MockResponse(exc.status, error_body(
                str(exc), "invalid_request_error")), True))
        self._pump()

    def _next_request(self) -> tuple[MockRequest, bool] | None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEADER_BYTES:
                raise HttpError(431, "header too large")
            return None
        method, path, version, headers = parse_head(bytes(self.buf[:end]))
        start = end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            decoded = parse_chunked(self.buf, start)
            if decoded is None:
                return None
            body, stop = decoded
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError as exc:
                raise HttpError(400, "bad content-length") from exc
            if length < 0 or length > MAX_BODY_BYTES:
                raise HttpError(413, "body too large")
            if len(self.buf) < start + length:
                return None
            body, stop = bytes(self.buf[start:start + length]), start + length
        del self.buf[:stop]
        conn = headers.get("connection", "").lower()
        close = conn == "close" or (version == "HTTP/1.0" and conn != "keep-alive")
        if close:
            self.closing = True
        return MockRequest(method, path, headers, body), close

    def _pump(self) -> None:
        while self.task is None and self.pending:
            item, close = self.pending.popleft()
            resp = item if isinstance(item, MockResponse) else self.mock.handle(item)
            if resp.delay_s > 0 or (resp.events is not None and resp.chunk_delay_s > 0):
                self.task = asyncio.get_running_loop().create_task(self._slow(resp, close))
                return
            self._write_now(resp, close)

    def _write_now(self, resp: MockResponse, close: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if resp.abort and resp.events is None:
            transport.close()  # no answer at all
            return
        if resp.events is None:
            transport.write(encode_head(resp.status, resp.content_type, len(resp.body), close,
                                        resp.headers) + resp.body)
        else:
            end = [] if resp.abort else [b"0\r\n\r\n"]
            transport.write(b"".join([encode_head(resp.status, resp.content_type, None, close,
                                                  resp.headers),
                                      *map(encode_chunk, resp.events), *end]))
        if resp.abort or close:
            transport.close()  # after what was written: a stream cut without its last chunk

    async def _slow(self, resp: MockResponse, close: bool) -> None:
        try:
            await asyncio.sleep(resp.delay_s)
            transport = self.transport
            if resp.events is None or transport is None:
                self._write_now(resp, close)
            else:
                transport.write(encode_head(resp.status, resp.content_type, None, close,
                                            resp.headers))
                for event in resp.events:
                    if transport.is_closing():
                        return
                    transport.write(encode_chunk(event))
                    await asyncio.sleep(resp.chunk_delay_s)
                if resp.abort:
                    transport.close()
                    return
                transport.write(b"0\r\n\r\n")
                if close:
                    transport.close()
        finally:
            self.task = None
        self._pump()


async def start_server(host: str = "127.0.0.1", port: int = 0,
                       config: MockConfig | None = None,
                       mock: MockUpstream | None = None) -> tuple[asyncio.Server, MockUpstream]:
    """Start listening on the running loop; returns the server and the mock it serves."""
    mock = mock or MockUpstream(config)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: MockProtocol(mock), host, port, backlog=4096)
    return server, mock


def bound_port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


async def serve(host: str = "127.0.0.1", port: int = 0, config: MockConfig | None = None,
                on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until cancelled; ``on_ready`` gets the bound port once connections are accepted."""
    server, _ = await start_server(host, port, config)
    async with server:
        if on_ready is not None:
            on_ready(bound_port(server))
        await server.serve_forever()


def new_event_loop(use_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """uvloop's loop when asked for and installed, else asyncio's."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class MockServerThread:
    """The mock on a free loopback port in a daemon thread: ``with MockServerThread() as m:``."""

    def __init__(self, config: MockConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.mock = MockUpstream(config)
        self.host = host
        self.port = port
        self._loop = new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mock-upstream", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return f"{self.url}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server, _ = self._loop.run_until_complete(
            start_server(self.host, self.port, mock=self.mock))
        self.port = bound_port(self._server)
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.close()

    def start(self) -> MockServerThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("mock upstream did not start")
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> MockServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------------------- ASGI wrapper

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def build_app(config: MockConfig | None = None,
              mock: MockUpstream | None = None) -> Callable[..., Awaitable[None]]:
    """The same mock as a minimal ASGI app (``app.mock`` is its :class:`MockUpstream`)."""
    state = mock or MockUpstream(config)

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = bytearray()
        for _ in range(MAX_BODY_BYTES):  # bounded: one message per round
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        resp = state.handle(MockRequest(scope["method"], scope["path"], headers, bytes(body)))
        await asyncio.sleep(resp.delay_s)
        extra = [(b"cache-control", b"no-cache")] if resp.events is not None else []
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": [(b"content-type", resp.content_type.encode()), *extra]})
        for event in resp.events or []:
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(resp.chunk_delay_s)
        await send({"type": "http.response.body", "body": resp.body})

    app.mock = state  # type: ignore[attr-defined]
    return app


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000, help="0 picks a free port (printed)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="latency before each answer")
    p.add_argument("--chunk-delay-ms", type=float, default=0.0, help="latency between chunks")
    p.add_argument("--fail-rate", type=float, default=0.0, help="share of 500 answers, 0..1")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure draws")
    p.add_argument("--reply", default=DEFAULT_REPLY)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated")
    p.add_argument("--require-key", default=None, help="answer 401 to any other bearer key")
    p.add_argument("--no-uvloop", action="store_true", help="use asyncio's own loop")
    args = p.parse_args(list(argv) if argv is not None else None)
    if not 0.0 <= args.fail_rate <= 1.0:
        p.error("--fail-rate must be within 0..1")
    return args


def config_from_args(args: argparse.Namespace) -> MockConfig:
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    return MockConfig(delay_ms=args.delay_ms, chunk_delay_ms=args.chunk_delay_ms,
                      fail_rate=args.fail_rate, seed=args.seed, reply=args.reply,
                      models=models or DEFAULT_MODELS, require_key=args.require_key)


def main(argv: Iterable[str] | None = None) -> None:
    args = parse_args(argv)
    config = config_from_args(args)

    def ready(port: int) -> None:
        print(f"mock upstream listening on http://{args.host}:{port}", flush=True)

    loop = new_event_loop(not args.no_uvloop)
    try:
        loop.run_until_complete(serve(args.host, args.port, config, ready))
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()


if __name__ == "__main__":
    main()
