"""workers/telemetry.py: providers by config, the worker's SERVER span continuing a caller's
traceparent (streams included), and queue/prefill/decode spans from the engine's timestamps."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.engine.sequence import RequestMetrics
from workers.telemetry import (
    TraceMiddleware,
    epoch_ns,
    inject_trace_headers,
    make_tracer_provider,
    otlp_traces_url,
    record_engine_spans,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    made = make_tracer_provider(service_name="test-worker", exporter="none",
                                span_processors=[SimpleSpanProcessor(exporter)])
    assert made is not None
    return made


def metrics(t0: float) -> RequestMetrics:
    return RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.010,
                          first_token_time=t0 + 0.030, last_token_time=t0 + 0.070,
                          finished_time=t0 + 0.071, num_prompt_tokens=12,
                          num_generation_tokens=5, num_preemptions=1)


def worker_app(provider: TracerProvider | None) -> Starlette:
    """A stand-in for workers/server.py: engine spans recorded when the request finishes."""

    async def chat(request: Request) -> Response:
        body = await request.json()
        headers: dict[str, str] = {}
        inject_trace_headers(headers)  # what the worker would send on, if it called further
        finished = metrics(time.monotonic() - 0.1)
        if body.get("stream"):
            async def events() -> AsyncIterator[bytes]:
                yield b"data: {}\n\n"
                record_engine_spans(provider, finished, prompt_tokens=12, cached_tokens=4,
                                    completion_tokens=5)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        record_engine_spans(provider, finished, prompt_tokens=12, cached_tokens=4,
                            completion_tokens=5)
        return JSONResponse({"sent_on": headers})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def broken(request: Request) -> Response:
        return JSONResponse({}, status_code=503)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/health", health), Route("/v1/broken", broken)])
    app.add_middleware(TraceMiddleware, tracer_provider=provider)
    return app


def client(app: Starlette) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def test_no_provider_when_tracing_is_off() -> None:
    assert make_tracer_provider(service_name="x", exporter="none") is None
    with pytest.raises(ValueError):
        make_tracer_provider(service_name="x", exporter="jaeger")


@pytest.mark.parametrize("exporter_name", ["console", "otlp"])
def test_console_and_otlp_providers(exporter_name: str) -> None:
    provider = make_tracer_provider(service_name="svc", exporter=exporter_name,
                                    endpoint="http://127.0.0.1:9/v1/traces", sample_ratio=0.5)
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "svc"
        assert "TraceIdRatioBased{0.5}" in provider.sampler.get_description()
        assert provider.sampler.get_description().startswith("ParentBased")
    finally:
        provider.shutdown()  # nothing was recorded: nothing is sent


def test_otlp_endpoint_gets_the_traces_path() -> None:
    assert otlp_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("http://c:4318/custom/traces") == "http://c:4318/custom/traces"
    assert otlp_traces_url("") == ""


async def test_middleware_continues_the_callers_trace_with_engine_spans(provider, exporter):
    async with client(worker_app(provider)) as c:
        r = await c.post("/v1/chat/completions", json={}, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"POST /v1/chat/completions", "queue", "prefill", "decode"}
    server = spans["POST /v1/chat/completions"]
    assert server.kind == SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_ID
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    for name in ("queue", "prefill", "decode"):
        span = spans[name]
        assert span.context.trace_id == server.context.trace_id
        assert span.parent is not None and span.parent.span_id == server.context.span_id
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    assert queue.start_time < queue.end_time == prefill.start_time < prefill.end_time
    assert prefill.end_time == decode.start_time < decode.end_time
    assert abs((queue.end_time - queue.start_time) - 10_000_000) < 1000  # 10 ms, to the us
    assert abs((decode.end_time - decode.start_time) - 41_000_000) < 1000  # to finished_time
    assert server.start_time <= time.time_ns() and decode.end_time <= time.time_ns()
    assert prefill.attributes["gen_ai.usage.input_tokens"] == 12
    assert prefill.attributes["switchboard.engine.cached_tokens"] == 4
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5
    assert queue.attributes["switchboard.engine.preemptions"] == 1
    # Inside the handler the server span is current: a further hop would continue it.
    sent = r.json()["sent_on"]["traceparent"]
    assert sent == f"00-{TRACE_ID}-{format(server.context.span_id, '016x')}-01"


async def test_a_streamed_answer_is_inside_its_span(provider, exporter):
    async with client(worker_app(provider)) as c:
        r = await c.post("/v1/chat/completions", json={"stream": True},
                         headers={"traceparent": TRACEPARENT})
    assert r.text.endswith("data: [DONE]\n\n")
    spans = by_name(exporter.get_finished_spans())
    server = spans["POST /v1/chat/completions"]
    assert spans["decode"].parent.span_id == server.context.span_id
    # The engine spans were recorded while the body streamed: the server span outlives them.
    assert server.end_time >= max(s.end_time for s in spans.values())


async def test_new_trace_without_traceparent_and_errors_marked(provider, exporter):
    async with client(worker_app(provider)) as c:
        await c.post("/v1/chat/completions", json={},
                     headers={"traceparent": "00-garbage-00f067aa0ba902b7-01"})
        assert (await c.get("/v1/broken")).status_code == 503
        assert (await c.get("/health")).status_code == 200
    spans = exporter.get_finished_spans()
    server = by_name(spans)["POST /v1/chat/completions"]
    assert server.parent is None  # an unreadable traceparent starts a new trace
    broken = by_name(spans)["GET /v1/broken"]
    assert broken.status.status_code == StatusCode.ERROR
    assert not any("health" in s.name for s in spans)


async def test_no_provider_is_a_passthrough(exporter):
    async with client(worker_app(None)) as c:
        r = await c.post("/v1/chat/completions", json={}, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200
    assert r.json()["sent_on"] == {}  # no span, nothing to propagate
    assert exporter.get_finished_spans() == ()


def test_engine_spans_skip_missing_phases_and_need_a_parent(provider, exporter):
    t0 = time.monotonic()
    queued_only = RequestMetrics(arrival_time=t0, first_scheduled_time=None)
    record_engine_spans(provider, metrics(t0), prompt_tokens=1, cached_tokens=0,
                        completion_tokens=1)
    assert exporter.get_finished_spans() == ()  # no current span: nothing to hang them on
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request"):
        record_engine_spans(provider, queued_only, prompt_tokens=1, cached_tokens=0,
                            completion_tokens=0)
        no_decode = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.001,
                                   first_token_time=t0 + 0.002)
        record_engine_spans(provider, no_decode, prompt_tokens=1, cached_tokens=0,
                            completion_tokens=1)
        record_engine_spans(None, metrics(t0), prompt_tokens=1, cached_tokens=0,
                            completion_tokens=1)
    names = [s.name for s in exporter.get_finished_spans()]
    assert names == ["queue", "prefill", "request"]


def test_monotonic_to_epoch() -> None:
    assert abs(epoch_ns(time.monotonic()) - time.time_ns()) < 5_000_000
