"""Gateway traces through an in-memory exporter: the request span and its auth, route,
prepare, limits, cache and dispatch children in one trace, a caller's traceparent continued,
traceparent sent upstream, a dispatch span per fallback attempt, streams inside their span,
and no prompt text or keys in any attribute."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from bench.common.mock_upstream import MockMode, MockServerThread
from tests.gateway.support import CHAT_MODEL as MODEL
from tests.gateway.support import (
    GatewayWorld,
    bearer,
    ok,
    priced_deployment,
    serve_world,
)
from workers.telemetry import make_tracer_provider

MOCKS = ("a", "b")
PROMPT = "The secret plans of Atlantis, in detail"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
STEPS = ("auth", "route", "prepare", "limits", "cache")


@dataclass
class World(GatewayWorld):
    exporter: InMemorySpanExporter
    prompt: ClassVar[str] = PROMPT

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


def in_memory_provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = make_tracer_provider(service_name="test-gateway", exporter="none",
                                    span_processors=[SimpleSpanProcessor(exporter)])
    assert provider is not None
    return provider


@asynccontextmanager
async def make_world(sqlite_url: str, tmp_path, mocks, *, traced: bool = True,
                     **overrides: Any) -> AsyncIterator[World]:
    exporter = InMemorySpanExporter()
    provider = in_memory_provider(exporter) if traced else None
    deployments = [priced_deployment("a", mocks["a"], "1"),
                   priced_deployment("b", mocks["b"], "2")]
    try:
        async with serve_world(World, sqlite_url, tmp_path, mocks, deployments,
                               app_kwargs={"tracer_provider": provider},
                               fields={"exporter": exporter}, **overrides) as w:
            yield w
    finally:
        if provider is not None:
            provider.shutdown()


@pytest.fixture
async def world(sqlite_url, tmp_path, mocks: dict[str, MockServerThread]
                ) -> AsyncIterator[World]:
    async with make_world(sqlite_url, tmp_path, mocks) as w:
        yield w


def request_span(spans: list[ReadableSpan]) -> ReadableSpan:
    [server] = [s for s in spans if s.kind == SpanKind.SERVER]
    return server


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None
            and s.parent.span_id == parent.context.span_id]


def hex_trace(span: ReadableSpan) -> str:
    return format(span.context.trace_id, "032x")


def hex_span(span: ReadableSpan) -> str:
    return format(span.context.span_id, "016x")


def assert_nothing_private(spans: list[ReadableSpan], *private: str) -> None:
    for span in spans:
        for value in (span.attributes or {}).values():
            for secret in private:
                assert secret not in str(value), (span.name, value)
        for event in span.events:
            for value in (event.attributes or {}).values():
                for secret in private:
                    assert secret not in str(value), (span.name, event.name)


async def test_request_span_and_its_steps_in_one_trace(world):
    r = await world.chat()
    answer = ok(r)
    spans = world.spans()
    server = request_span(spans)
    assert server.name == "POST /v1/chat/completions"
    assert server.parent is None  # no traceparent came in: a new trace
    assert {s.context.trace_id for s in spans} == {server.context.trace_id}
    steps = children(spans, server)
    assert [s.name for s in steps] == [*STEPS, "dispatch"]  # in the order they ended
    assert all(a.end_time <= b.start_time for a, b in itertools.pairwise(steps))
    assert all(server.start_time <= s.start_time and s.end_time <= server.end_time
               for s in steps)
    dispatch = steps[-1]
    assert dispatch.attributes["switchboard.deployment"] == "a"
    assert dispatch.attributes["switchboard.attempt"] == 1
    assert dispatch.attributes["switchboard.status"] == "ok"
    assert dispatch.status.status_code != StatusCode.ERROR
    attrs = server.attributes
    assert attrs["switchboard.request_id"] == r.headers["x-request-id"]
    assert attrs["switchboard.tenant_id"] == world.tenant.tenant_id
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["switchboard.deployment"] == "a"
    assert attrs["switchboard.status"] == "ok"
    assert attrs["switchboard.cache_hit"] == "none"
    assert attrs["switchboard.attempts"] == 1
    assert attrs["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]
    assert attrs["http.response.status_code"] == 200
    assert attrs["http.route"] == "/v1/chat/completions"
    limits = next(s for s in steps if s.name == "limits")
    assert limits.attributes["switchboard.admitted"] is True
    assert_nothing_private(spans, PROMPT, world.tenant.key, "sk-a-upstream-secret",
                           answer["choices"][0]["message"]["content"])


async def test_a_callers_traceparent_is_continued_and_sent_upstream(world):
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    ok(await world.chat(headers={"traceparent": traceparent, "tracestate": "vendor=1"}))
    spans = world.spans()
    server = request_span(spans)
    assert hex_trace(server) == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_ID
    assert {hex_trace(s) for s in spans} == {TRACE_ID}
    [dispatch] = [s for s in spans if s.name == "dispatch"]
    sent = world.mocks["a"].mock.last_request["headers"]
    # The upstream (a remote worker) continues the trace under this attempt's span.
    assert sent["traceparent"] == f"00-{TRACE_ID}-{hex_span(dispatch)}-01"
    assert sent["tracestate"] == "vendor=1"


async def test_each_fallback_attempt_is_a_dispatch_span(world):
    world.mocks["a"].mock.mode = MockMode(status=500)
    r = await world.chat()
    assert r.headers["x-switchboard-deployment"] == "b"
    spans = world.spans()
    server = request_span(spans)
    first, second = [s for s in children(spans, server) if s.name == "dispatch"]
    assert (first.attributes["switchboard.deployment"], first.attributes["switchboard.attempt"]
            ) == ("a", 1)
    assert first.status.status_code == StatusCode.ERROR
    assert (second.attributes["switchboard.deployment"],
            second.attributes["switchboard.attempt"]) == ("b", 2)
    assert second.status.status_code != StatusCode.ERROR
    assert first.end_time <= second.start_time
    assert server.attributes["switchboard.attempts"] == 2
    # Each upstream saw its own attempt as the parent.
    for mock, span in ((world.mocks["a"], first), (world.mocks["b"], second)):
        assert mock.mock.last_request["headers"]["traceparent"].split("-")[2] == hex_span(span)


async def test_all_attempts_failing_marks_the_request_failed(world):
    for server in world.mocks.values():
        server.mock.mode = MockMode(status=503)
    r = await world.chat()
    assert r.status_code >= 500
    spans = world.spans()
    server = request_span(spans)
    assert server.status.status_code == StatusCode.ERROR
    assert server.attributes["switchboard.status"] == "error"
    dispatches = [s for s in spans if s.name == "dispatch"]
    assert len(dispatches) == 2
    assert all(s.status.status_code == StatusCode.ERROR for s in dispatches)


async def test_a_stream_ends_inside_its_spans(world):
    r = await world.chat(stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    spans = world.spans()
    server = request_span(spans)
    [dispatch] = [s for s in spans if s.name == "dispatch"]
    assert dispatch.parent.span_id == server.context.span_id
    assert dispatch.end_time <= server.end_time
    assert server.attributes["switchboard.status"] == "ok"
    assert server.attributes["switchboard.stream"] is True
    assert server.attributes["gen_ai.usage.output_tokens"] > 0


async def test_refusals_and_bad_keys_are_traced_without_secrets(world):
    bad_key = world.tenant.key[:-4] + "0000"
    r = await world.client.post("/v1/chat/completions", headers=bearer(bad_key),
                                json={"model": MODEL, "messages": [
                                    {"role": "user", "content": PROMPT}]})
    assert r.status_code == 401
    spans = world.spans()
    server = request_span(spans)
    assert server.attributes["http.response.status_code"] == 401
    [auth] = children(spans, server)
    assert auth.name == "auth"
    assert auth.status.status_code == StatusCode.ERROR
    assert auth.attributes["error.type"] == "invalid_api_key"
    assert_nothing_private(spans, bad_key, PROMPT)


async def test_cache_hits_have_no_dispatch(world):
    ok(await world.chat(temperature=0))
    await world.settled()  # the answer is stored
    world.exporter.clear()
    r = await world.chat(temperature=0)
    assert r.headers["x-cache"] == "hit"
    spans = world.spans()
    server = request_span(spans)
    assert [s.name for s in children(spans, server)] == list(STEPS)
    [cache] = [s for s in spans if s.name == "cache"]
    assert cache.attributes["switchboard.cache_hit"] == "exact"
    assert server.attributes["switchboard.cache_hit"] == "exact"


async def test_health_and_metrics_are_not_traced(world):
    assert (await world.client.get("/health/live")).status_code == 200
    assert (await world.client.get("/metrics")).status_code == 200
    assert world.spans() == []
    r = await world.client.get("/v1/models", headers=bearer(world.tenant.key))
    assert r.status_code == 200
    assert request_span(world.spans()).name == "GET /v1/models"


async def test_tracing_off_sends_no_traceparent(sqlite_url, tmp_path, mocks):
    async with make_world(sqlite_url, tmp_path, mocks, traced=False) as w:
        traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
        ok(await w.chat(headers={"traceparent": traceparent}))
        assert w.app.state.gateway.tracing.tracer is None
        assert "traceparent" not in w.mocks["a"].mock.last_request["headers"]
        assert w.spans() == []


async def test_settings_make_the_provider_and_close_shuts_it(sqlite_url, tmp_path, mocks):
    shutdowns: list[bool] = []
    async with make_world(sqlite_url, tmp_path, mocks, traced=False, otel_exporter="console",
                          otel_service_name="sb-test") as w:
        provider = w.app.state.gateway.tracing.provider
        assert provider is not None
        assert provider.resource.attributes["service.name"] == "sb-test"
        shutdown = provider.shutdown

        def counted() -> None:
            shutdowns.append(True)
            shutdown()

        provider.shutdown = counted  # type: ignore[method-assign]
    assert shutdowns == [True]  # the app made it, so the app's close flushed and stopped it
