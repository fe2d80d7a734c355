"""Gateway traces: the app's tracer, the request path's child spans, and their attributes.

Each app owns one `Tracing` (on its state, like its metrics registry): a tracer over the app's
own provider, or nothing when `otel_exporter` is "none", and then every helper here is a
constant no-op. The SERVER span of a request comes from `GatewayMiddleware`; the request path
opens `auth`, `route`, `limits` and `cache` under it, and a `dispatch` span per deployment
tried. Attributes carry ids, names, statuses and counts only: never prompt or completion text,
keys or secrets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from gateway.errors import APIError
from workers.telemetry import inject_trace_headers, make_tracer_provider

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from gateway.settings import Settings

__all__ = ["Dispatches", "Tracing", "annotate", "current_span", "inject_trace_headers"]

GATEWAY_TRACER = "switchboard.gateway"
# Attribute names (OpenTelemetry's gen_ai.* where one exists).
REQUEST_ID = "switchboard.request_id"
TENANT_ID = "switchboard.tenant_id"
MODEL = "gen_ai.request.model"
DEPLOYMENT = "switchboard.deployment"
ATTEMPT = "switchboard.attempt"
ATTEMPTS = "switchboard.attempts"
STATUS = "switchboard.status"
CACHE_HIT = "switchboard.cache_hit"
STREAM = "switchboard.stream"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_TOKENS = "switchboard.cached_tokens"
ERROR_TYPE = "error.type"

_OFF: AbstractContextManager[Span] = nullcontext(INVALID_SPAN)


class Tracing:
    """The app's tracer, or none: `span()` is then a shared null context."""

    def __init__(self, provider: TracerProvider | None, *, owned: bool = True) -> None:
        self.provider = provider
        self.tracer: Tracer | None = None if provider is None else provider.get_tracer(
            GATEWAY_TRACER)
        self._owned = owned

    @classmethod
    def from_settings(cls, settings: Settings) -> Tracing:
        return cls(make_tracer_provider(
            service_name=settings.otel_service_name, exporter=settings.otel_exporter,
            endpoint=settings.otel_endpoint, sample_ratio=settings.otel_sample_ratio))

    @classmethod
    def off(cls) -> Tracing:
        return cls(None)

    def span(self, name: str, attributes: Mapping[str, AttributeValue] | None = None
             ) -> AbstractContextManager[Span]:
        """A child of the current span, current inside the block; an exception marks it
        failed with its error code or type (no message, no stack: they may quote input)."""
        if self.tracer is None:
            return _OFF
        return _child(self.tracer, name, attributes)

    def dispatches(self) -> Dispatches:
        return Dispatches(self.tracer)

    async def shutdown(self) -> None:
        """Flush and stop the provider this app made (exporting may block: off the loop)."""
        if self._owned and self.provider is not None:
            await asyncio.to_thread(self.provider.shutdown)


@contextmanager
def _child(tracer: Tracer, name: str, attributes: Mapping[str, AttributeValue] | None
           ) -> Iterator[Span]:
    with tracer.start_as_current_span(name, attributes=attributes, record_exception=False,
                                      set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            failed(span, exc)
            raise


def failed(span: Span, exc: BaseException) -> None:
    """Mark `span` failed by what went wrong (an error code, or the exception's type)."""
    if isinstance(exc, asyncio.CancelledError):
        span.set_attribute(STATUS, "aborted")
        return
    kind = (exc.code or str(exc.status)) if isinstance(exc, APIError) else type(exc).__name__
    span.set_attribute(ERROR_TYPE, kind)
    span.set_status(Status(StatusCode.ERROR, kind))


def current_span() -> Span:
    """The current span (the request's SERVER span in a handler); a non-recording one when
    tracing is off."""
    return trace.get_current_span()


def annotate(span: Span, attributes: Mapping[str, AttributeValue | None]) -> None:
    """Set the attributes that have a value; nothing at all on a span that is not recorded."""
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


class Dispatches:
    """A `dispatch` span per deployment tried, under the request span.

    `prepared` names a call's deployment; `started` is the fallbacks' `on_call` hook: it ends
    the previous attempt's span (that one failed, or there would be no next) and makes the new
    one current, so the upstream request carries its `traceparent`. That hook runs inside the
    dispatch task (`until_done_or_disconnect`), whose context is its own copy: the span stays
    current there and nowhere else. `finish` ends the last span when the answer is over
    (streams included)."""

    def __init__(self, tracer: Tracer | None) -> None:
        self._tracer = tracer
        self._parent = otel_context.get_current() if tracer is not None else None
        self._named: list[tuple[object, str]] = []
        self._call: object | None = None
        self._span: Span | None = None
        self._token: object | None = None
        self._attempts = 0

    def prepared(self, call: object, deployment: str) -> None:
        if self._tracer is not None:
            self._named.append((call, deployment))

    def started(self, call: object) -> None:
        if self._tracer is None or call is self._call:
            return
        if self._span is not None:
            self._span.set_status(Status(StatusCode.ERROR, "fell back"))
            self._span.end()
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
        self._attempts += 1
        name = next((n for c, n in self._named if c is call), "")
        self._call = call
        self._span = self._tracer.start_span("dispatch", context=self._parent, attributes={
            DEPLOYMENT: name, ATTEMPT: self._attempts})
        self._token = otel_context.attach(trace.set_span_in_context(self._span, self._parent))

    def finish(self, status: str) -> None:
        if self._span is None:
            return
        self._span.set_attribute(STATUS, status)
        if status == "error":
            self._span.set_status(Status(StatusCode.ERROR, status))
        self._span.end()
        self._span = None

    @property
    def attempts(self) -> int:
        return self._attempts
