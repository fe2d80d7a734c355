"""Structured logs: JSON lines with the request, tenant and trace of the request they were
logged in, credentials redacted wherever they appear, and prompt or completion text only
when `log_prompts` is set."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from bench.common.mock_upstream import DEFAULT_REPLY, MockServerThread
from gateway.app import create_app
from gateway.observability.logs import (
    REDACTED,
    ContextFilter,
    JsonFormatter,
    TextFormatter,
    bind_tenant,
    configure_logging,
    configured_secrets,
    redact,
    request_log,
)
from tests.gateway.support import (
    bearer,
    in_process,
    mock_deployment,
    ok,
    seed_tenant,
    settings,
    write_deployments,
)
from workers.telemetry import make_tracer_provider

PROMPT = "my diary: the vault code is 4711"
TENANT_KEY = "sk-sb-abcdefghijkl-" + "0123456789abcdef" * 2 + "01234567"
ADMIN_KEY = "sk-sb-admin-abcdefghijkl-" + "f" * 40
SERVER_SECRET = "server-side-secret-value"

Lines = Callable[[], list[dict[str, Any]]]


def handler_into(stream: io.StringIO, formatter: logging.Formatter) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter)
    return handler


@pytest.fixture
def lines() -> Iterator[Lines]:
    """What the root logger writes at INFO, as parsed JSON lines."""
    stream = io.StringIO()
    handler = handler_into(stream, JsonFormatter(secrets=[SERVER_SECRET]))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(level)


# ------------------------------------------------------------------------------ the formatter


def test_a_line_is_one_json_object_with_extras_and_the_exception(lines):
    log = logging.getLogger("switchboard.test")
    log.info("plain %s", "message", extra={"deployment": "a", "tokens": {"prompt": 3}})
    try:
        raise RuntimeError(f"upstream said: bad key {TENANT_KEY}")
    except RuntimeError:
        log.exception("it failed")
    plain, failed = lines()
    assert plain["message"] == "plain message"
    assert plain["level"] == "info" and plain["logger"] == "switchboard.test"
    assert plain["ts"].endswith("Z") and "T" in plain["ts"]
    assert plain["deployment"] == "a" and plain["tokens"] == {"prompt": 3}
    assert not {"request_id", "tenant_id", "trace_id", "span_id"} & set(plain)  # no request
    assert failed["level"] == "error"
    assert "RuntimeError: upstream said: bad key sk-sb-abcdefghijkl-[REDACTED]" in failed[
        "exception"]
    assert TENANT_KEY not in json.dumps(failed)


def test_context_fields_inside_a_request_and_a_span(lines):
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(service_name="t", exporter="none",
                                    span_processors=[SimpleSpanProcessor(exporter)])
    assert provider is not None
    with request_log("req-1"), provider.get_tracer("t").start_as_current_span("s") as span:
        logging.getLogger("x").warning("before auth")
        bind_tenant("tenant-9")
        logging.getLogger("x").warning("after auth")
    logging.getLogger("x").warning("outside")
    before, after, outside = lines()
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert before["request_id"] == "req-1" and "tenant_id" not in before
    assert after["tenant_id"] == "tenant-9" and after["trace_id"] == trace_id
    assert after["span_id"] == format(span.get_span_context().span_id, "016x")
    assert "request_id" not in outside and "trace_id" not in outside


# ------------------------------------------------------------------------------- redaction


@pytest.mark.parametrize(("raw", "shown"), [
    (f"key {TENANT_KEY} used", "key sk-sb-abcdefghijkl-[REDACTED] used"),
    (f"admin {ADMIN_KEY}", "admin sk-sb-admin-abcdefghijkl-[REDACTED]"),
    ("openai sk-proj-AbC123xyz789_-q", "openai sk-[REDACTED]"),
    ("Authorization: Bearer abc.def-ghi", "Authorization: Bearer [REDACTED]"),
    ("header basic dXNlcjpwYXNz", "header basic [REDACTED]"),
    ("redis://:hunter2@cache:6379/0 down", "redis://:[REDACTED]@cache:6379/0 down"),
    ("postgresql://app:p%40ss@db/app", "postgresql://app:[REDACTED]@db/app"),
    ('{"api_key": "abc123", "n": 1}', '{"api_key": "[REDACTED]", "n": 1}'),
    ("password=letmein&user=x", "password=[REDACTED]&user=x"),
    ("secret_key: s3cr3t", "secret_key: [REDACTED]"),
    (f"configured {SERVER_SECRET}!", f"configured {REDACTED}!"),
    ("prompt_tokens=12 max_tokens: 5 the sk-sb- prefix", "prompt_tokens=12 max_tokens: 5 the "
                                                         "sk-sb- prefix"),
])
def test_redaction(raw: str, shown: str) -> None:
    assert redact(raw, [SERVER_SECRET]) == shown


def test_extra_fields_named_like_secrets_are_masked(lines):
    logging.getLogger("x").warning("config", extra={
        "api_key": "plain-looking", "headers": {"Authorization": "whatever", "accept": "*/*"},
        "upstream": f"http://u:pw@h/v1?key={SERVER_SECRET}", "metrics_token": "t0k",
        "prompt_tokens": 7})
    [line] = lines()
    assert line["api_key"] == REDACTED and line["metrics_token"] == REDACTED
    assert line["headers"] == {"Authorization": REDACTED, "accept": "*/*"}
    assert line["upstream"] == f"http://u:{REDACTED}@h/v1?key={REDACTED}"
    assert line["prompt_tokens"] == 7


def test_text_format_is_redacted_too() -> None:
    stream = io.StringIO()
    log = logging.getLogger("switchboard.text-test")
    log.addHandler(handler_into(stream, TextFormatter()))
    log.propagate = False
    try:
        with request_log("req-7"):
            log.warning("using %s", TENANT_KEY)
    finally:
        log.handlers.clear()
        log.propagate = True
    out = stream.getvalue()
    assert "[req-7]" in out and "sk-sb-abcdefghijkl-[REDACTED]" in out
    assert TENANT_KEY not in out


def test_configure_logging_replaces_the_root_handlers(capsys) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("warning", "json", secrets=[SERVER_SECRET])
        [handler] = root.handlers
        assert root.level == logging.WARNING
        assert isinstance(handler.formatter, JsonFormatter)
        assert getattr(handler, "stream", None) is sys.stderr
        logging.getLogger("x").warning("the secret is %s", SERVER_SECRET)
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert line["message"] == f"the secret is {REDACTED}"
        configure_logging("debug", "text")
        assert isinstance(root.handlers[0].formatter, TextFormatter)
        assert root.level == logging.DEBUG
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_configured_secrets_come_from_the_settings(sqlite_url, tmp_path) -> None:
    cfg = settings(sqlite_url, tmp_path, worker_secret="w-secret", metrics_token="")
    assert set(configured_secrets(cfg)) == {cfg.secret_key, "w-secret"}


# ------------------------------------------------------------------------ through the gateway


@pytest.fixture(scope="module")
def mock() -> Iterator[MockServerThread]:
    with MockServerThread() as server:
        yield server


@dataclass
class Gateway:
    app: FastAPI
    client: httpx.AsyncClient
    key: str
    tenant_id: str
    exporter: InMemorySpanExporter

    async def chat(self, key: str | None = None, **extra: Any) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=chat_body(**extra),
                                      headers=bearer(key or self.key))

    def server_span(self) -> ReadableSpan:
        [server] = [s for s in self.exporter.get_finished_spans()
                    if s.kind == SpanKind.SERVER]
        return server


@asynccontextmanager
async def gateway(sqlite_url: str, tmp_path, mock: MockServerThread, **overrides: Any
                  ) -> AsyncIterator[Gateway]:
    path = write_deployments(tmp_path, [mock_deployment(mock.base_url)])
    cfg = settings(sqlite_url, tmp_path, deployments_file=path, **overrides)
    tenant = await seed_tenant(sqlite_url, tmp_path, name="acme")
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(service_name="t", exporter="none",
                                    span_processors=[SimpleSpanProcessor(exporter)])
    assert provider is not None
    app = create_app(cfg, tracer_provider=provider)
    try:
        async with in_process(app) as client:
            yield Gateway(app, client, tenant.key, tenant.tenant_id, exporter)
    finally:
        provider.shutdown()


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "mock-model", "messages": [{"role": "user", "content": PROMPT}], **extra}


async def test_request_lines_carry_request_tenant_and_trace(sqlite_url, tmp_path, mock, lines):
    async with gateway(sqlite_url, tmp_path, mock) as gw:
        r = await gw.chat()
        ok(r)
        server = gw.server_span()
        key, tenant_id = gw.key, gw.tenant_id
    out = lines()
    [access] = [line for line in out if line["logger"] == "switchboard.access"]
    assert access["message"] == "POST /v1/chat/completions 200"
    assert access["request_id"] == r.headers["x-request-id"]
    assert access["tenant_id"] == tenant_id
    assert access["trace_id"] == format(server.context.trace_id, "032x")
    assert access["span_id"] == format(server.context.span_id, "016x")
    assert (access["method"], access["path"], access["status"]) == (
        "POST", "/v1/chat/completions", 200)
    assert access["model"] == "mock-model" and access["deployment"] == "mock"
    assert access["outcome"] == "ok" and access["cache"] == "none"
    assert access["prompt_tokens"] > 0 and access["completion_tokens"] > 0
    assert access["duration_ms"] >= 0
    everything = json.dumps(out)
    for private in (PROMPT, "vault code", key, DEFAULT_REPLY, "sk-upstream-secret"):
        assert private not in everything  # the default: no text, no keys


async def test_refused_requests_are_logged_with_their_status(sqlite_url, tmp_path, mock,
                                                             lines):
    async with gateway(sqlite_url, tmp_path, mock) as gw:
        key = gw.key
        r = await gw.chat(key=key[:-4] + "0000")
        assert r.status_code == 401
        assert (await gw.client.get("/health/live")).status_code == 200
    access = [line for line in lines() if line["logger"] == "switchboard.access"]
    assert [(a["status"], a["path"]) for a in access] == [(401, "/v1/chat/completions")]
    assert "tenant_id" not in access[0]
    assert key[-20:] not in json.dumps(access)


@pytest.mark.parametrize("stream", [False, True])
async def test_log_prompts_logs_prompt_and_completion(sqlite_url, tmp_path, mock, lines,
                                                      stream):
    async with gateway(sqlite_url, tmp_path, mock, log_prompts=True) as gw:
        r = await gw.chat(stream=stream)
        assert r.status_code == 200
        key, tenant_id = gw.key, gw.tenant_id
    out = lines()
    [prompt] = [line for line in out if line["message"] == "prompt"]
    [completion] = [line for line in out if line["message"] == "completion"]
    assert prompt["prompt"]["messages"][0]["content"] == PROMPT
    assert prompt["tenant_id"] == tenant_id
    assert completion["completion"] == [DEFAULT_REPLY]
    assert completion["request_id"] == r.headers["x-request-id"]
    assert key not in json.dumps(out)


async def test_an_unhandled_error_is_a_500_line_and_a_failed_span(sqlite_url, tmp_path, mock,
                                                                 lines):
    async with gateway(sqlite_url, tmp_path, mock) as gw:
        async def broken(admission: Any) -> Any:
            raise RuntimeError(f"limiter exploded near {gw.key}")

        gw.app.state.gateway.limiter.admit = broken
        transport = httpx.ASGITransport(app=gw.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
            r = await c.post("/v1/chat/completions", json=chat_body(), headers=bearer(gw.key))
        assert r.status_code == 500
        server = gw.server_span()
    assert server.status.status_code == StatusCode.ERROR
    [limits] = [s for s in gw.exporter.get_finished_spans() if s.name == "limits"]
    assert limits.attributes["error.type"] == "RuntimeError"
    out = lines()
    [access] = [line for line in out if line["logger"] == "switchboard.access"]
    assert (access["status"], access["error"]) == (500, "RuntimeError")
    assert access["trace_id"] == format(server.context.trace_id, "032x")
    [failure] = [line for line in out if line["level"] == "error"]
    assert "limiter exploded" in failure["exception"]
    assert failure["tenant_id"] == gw.tenant_id
    assert gw.key not in json.dumps(out)  # the exception quoted the key: redacted
