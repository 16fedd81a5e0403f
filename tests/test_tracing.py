"""pdserve/tracing.py without processes: off by default (every call a no-op), and with an
in-memory exporter, stages recorded after the fact hang off the span their traceparent names."""

from __future__ import annotations

import time

import pytest

from pdserve import tracing

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402


def test_off_by_default_costs_nothing():
    assert not tracing.enabled()
    assert tracing.start_span("x") is None
    tracing.record_span("y", "00-" + "1" * 32 + "-" + "2" * 16 + "-01", time.monotonic())  # no error, no span
    tracing.setup_tracing("svc", None)  # no endpoint: stays off
    assert not tracing.enabled()


def test_recorded_stages_are_children_of_the_request_span(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    client = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    root = tracing.start_span("gateway.request", client, attributes={"pdserve.n": 2})
    assert root is not None and root.traceparent.startswith("00-" + "ab" * 16 + "-")
    t0 = time.monotonic()
    tracing.record_span("prefill.compute", root.traceparent, t0 - 0.25, t0, attributes={"pdserve.prompt_tokens": 7})
    tracing.record_span("ignored", None, t0)  # a request without trace context: nothing
    root.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"gateway.request", "prefill.compute"}
    stage, req = spans["prefill.compute"], spans["gateway.request"]
    assert stage.context.trace_id == req.context.trace_id == int("ab" * 16, 16)
    assert stage.parent.span_id == req.context.span_id and req.parent.span_id == int("cd" * 8, 16)
    assert abs((stage.end_time - stage.start_time) / 1e9 - 0.25) < 0.01  # the measured duration
    assert stage.attributes["pdserve.prompt_tokens"] == 7
