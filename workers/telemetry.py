"""OpenTelemetry traces shared by the gateway and the worker: a provider per app, a SERVER span
per HTTP exchange, W3C `traceparent` in and out, and the engine's queue/prefill/decode spans.

Nothing here touches OpenTelemetry's global tracer provider: tests build many apps in one
process, and each app (or worker) owns the provider it is given and shuts it down itself.
A provider of None means tracing is off; every helper then returns at once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    from workers.engine.sequence import RequestMetrics

WORKER_TRACER = "switchboard.worker"
PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = (b"traceparent", b"tracestate")
UNTRACED_PREFIXES = ("/health", "/metrics")  # probes and scrapes would drown the real traces
OTLP_TRACES_PATH = "/v1/traces"


def make_tracer_provider(*, service_name: str, exporter: str, endpoint: str = "",
                         sample_ratio: float = 1.0,
                         span_processors: Sequence[SpanProcessor] = ()
                         ) -> TracerProvider | None:
    """A provider for one app, or None when tracing is off ("none" and no processors).

    "otlp" batches spans to an OTLP/HTTP collector at `endpoint` (a bare `http://host:4318`
    gets `/v1/traces`; empty: the OTEL_EXPORTER_OTLP_*ENDPOINT variables, else localhost);
    "console" prints each span as it ends (development). `span_processors` are added as they
    are (tests pass a SimpleSpanProcessor over an InMemorySpanExporter). The root sampler keeps
    `sample_ratio` of new traces and follows the caller's decision for continued ones. The
    caller owns the provider: it must `shutdown()` it (that flushes what is batched).
    """
    if exporter not in ("none", "console", "otlp"):
        raise ValueError(f"unknown trace exporter {exporter!r} (none, console or otlp)")
    if exporter == "none" and not span_processors:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(min(1.0, max(0.0, sample_ratio)))),
        resource=Resource.create({"service.name": service_name}),
        shutdown_on_exit=False,  # the owner shuts it down; no atexit hook per test app
    )
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=otlp_traces_url(endpoint) or None)))
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    for processor in span_processors:
        provider.add_span_processor(processor)
    return provider


def otlp_traces_url(endpoint: str) -> str:
    """The collector's traces URL: `http://collector:4318` means its `/v1/traces`."""
    endpoint = endpoint.strip()
    if endpoint and urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + OTLP_TRACES_PATH
    return endpoint


def inject_trace_headers(headers: dict[str, str]) -> None:
    """Add `traceparent` (and `tracestate`) of the current span, so the next hop continues
    this trace; adds nothing when no span is current (tracing off)."""
    if trace.get_current_span().get_span_context().is_valid:
        PROPAGATOR.inject(headers)


def extract_context(headers: Sequence[tuple[bytes, bytes]]) -> Context:
    """The caller's trace context from ASGI headers, on an empty context (never the current
    one): without a valid `traceparent` the request starts a new trace."""
    carrier = {name.decode("latin-1"): value.decode("latin-1")
               for name, value in headers if name in TRACE_HEADERS}
    return PROPAGATOR.extract(carrier, context=Context())


def is_traced(path: str) -> bool:
    return not path.startswith(UNTRACED_PREFIXES)


async def serve_traced(tracer: Tracer, scope: Scope, receive: Receive, send: Send,
                       app: Callable[[Scope, Receive, Send], Awaitable[None]], *,
                       attributes: Mapping[str, AttributeValue] | None = None) -> None:
    """Run `app` inside a SERVER span that continues the caller's traceparent and lasts until
    the last byte is sent (streams included; nothing is buffered).

    The span is current while `app` runs (and so in the tasks it starts). It is named
    `METHOD /route/{template}` once routing has matched (bounded names), else `METHOD`."""
    method = scope.get("method", "GET")
    parent = extract_context(scope.get("headers", ()))
    span = tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes={
        "http.request.method": method, "url.path": scope.get("path", ""),
        **(attributes or {})})
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    status = 0

    async def send_traced(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    try:
        await app(scope, receive, send_traced)
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        otel_context.detach(token)
        route = getattr(scope.get("route"), "path", None)
        if route:
            span.update_name(f"{method} {route}")
            span.set_attribute("http.route", route)
        if status:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        span.end()


class TraceMiddleware:
    """Pure ASGI: a SERVER span per HTTP request (see `serve_traced`); /health and /metrics
    are not traced. With no provider it is a plain passthrough."""

    def __init__(self, app: ASGIApp, tracer_provider: TracerProvider | None) -> None:
        self.app = app
        self.tracer = None if tracer_provider is None else tracer_provider.get_tracer(
            WORKER_TRACER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.tracer is None or scope["type"] != "http" or not is_traced(scope["path"]):
            await self.app(scope, receive, send)
            return
        await serve_traced(self.tracer, scope, receive, send, self.app)


def record_engine_spans(tracer_provider: TracerProvider | None, metrics: RequestMetrics, *,
                        prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
    """After a request finished: `queue`, `prefill` and `decode` spans under the current span,
    timed from the engine's own timestamps (so they cost nothing while the request runs).

    A phase whose timestamps are missing (aborted while queued, no token yet) is left out, and
    so is everything when no span is current (no trace to hang them on)."""
    if tracer_provider is None:
        return
    parent = trace.get_current_span()
    if not parent.get_span_context().is_valid:
        return
    tracer = tracer_provider.get_tracer(WORKER_TRACER)
    end = metrics.finished_time or metrics.last_token_time
    phases: list[tuple[str, float | None, float | None, dict[str, AttributeValue]]] = [
        ("queue", metrics.arrival_time, metrics.first_scheduled_time,
         {"switchboard.engine.preemptions": metrics.num_preemptions}),
        ("prefill", metrics.first_scheduled_time, metrics.first_token_time,
         {"gen_ai.usage.input_tokens": prompt_tokens,
          "switchboard.engine.cached_tokens": cached_tokens}),
        ("decode", metrics.first_token_time, end,
         {"gen_ai.usage.output_tokens": completion_tokens}),
    ]
    for name, start, stop, attributes in phases:
        if start is None or stop is None:
            continue
        span = tracer.start_span(name, start_time=epoch_ns(start), attributes=attributes)
        span.end(end_time=epoch_ns(max(start, stop)))


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as epoch nanoseconds (what span times are)."""
    return round(monotonic_s * 1e9) + _monotonic_offset_ns()


@functools.cache
def _monotonic_offset_ns() -> int:
    return time.time_ns() - time.monotonic_ns()
