"""OpenTelemetry tracing across processes: off unless `--otlp-traces-endpoint URL` is given
(vLLM's flag); the SDK is the optional extra `pip install pdserve[tracing]`.

One trace per request. The gateway opens `gateway.request` (a child of the client's W3C
`traceparent` header when it sends one) and records `gateway.queue` (admission); the W3C trace
context travels in every internal message's `traceparent` field (protocol/messages.py). Workers
record their stages as children of it: `decode.reserve`, `prefill.queue`, `prefill.compute`,
`kv.transfer`, `decode.admission`, `decode` (until the request's last token) on a decode
worker, `colocated.generate` on a colocated one. Stages are recorded when they end, with the
start and end times measured in the process (wall clock from its monotonic clock), so a span
never has to live across engine loop iterations. Export is batched on a thread of the SDK's.

With tracing off every call here returns at once (`enabled()` is one global read).
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Annotated, Any

from pdserve.flag import Flag

# The settings field every process that exports traces has (workers and the gateway)
OtlpEndpoint = Annotated[
    str | None,
    Flag(
        "export OpenTelemetry traces (OTLP/HTTP, e.g. http://collector:4318/v1/traces); needs pdserve[tracing]",
        metavar="URL",
    ),
]

log = logging.getLogger(__name__)

_tracer: Any = None  # an opentelemetry Tracer once set up
_provider: Any = None
# The trace context of the request being handled, for the gateway's backend to put into messages.
current_traceparent: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_traceparent", default=None)


class TracingUnavailable(RuntimeError):
    pass


def setup_tracing(service_name: str, endpoint: str | None) -> None:
    """Export this process's spans to the OTLP/HTTP `endpoint` (e.g. http://collector:4318/v1/traces)."""
    global _tracer, _provider
    if not endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise TracingUnavailable(
            "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'pdserve[tracing]'"
        ) from None
    _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _tracer = _provider.get_tracer("pdserve")
    log.info("tracing: spans of %s go to %s", service_name, endpoint)


def shutdown() -> None:
    """Flush what is batched (at exit)."""
    if _provider is not None:
        _provider.shutdown()


def enabled() -> bool:
    return _tracer is not None


def wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (what spans carry)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _context(traceparent: str | None):
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None


def _traceparent(span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class OpenSpan:
    """A span started now and ended later (the gateway's request span)."""

    def __init__(self, span) -> None:
        self._span = span
        self.traceparent = _traceparent(span)

    def set(self, key: str, value) -> None:
        self._span.set_attribute(key, value)

    def end(self) -> None:
        self._span.end()


def start_span(name: str, parent: str | None = None, attributes: dict[str, Any] | None = None) -> OpenSpan | None:
    if _tracer is None:
        return None
    return OpenSpan(_tracer.start_span(name, context=_context(parent), attributes=attributes))


def record_span(
    name: str,
    parent: str | None,
    start_s: float,
    end_s: float | None = None,
    attributes: dict[str, Any] | None = None,
) -> None:
    """A finished stage, child of `parent` (a traceparent), from monotonic `start_s` to `end_s`
    (default: now). Nothing when tracing is off or the request carries no trace context."""
    if _tracer is None or not parent:
        return
    span = _tracer.start_span(name, context=_context(parent), start_time=wall_ns(start_s), attributes=attributes)
    span.end(end_time=wall_ns(time.monotonic() if end_s is None else end_s))
