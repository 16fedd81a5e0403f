"""OpenTelemetry traces across the gateway, a prefill worker and a decode worker (separate
processes, each exporting OTLP/HTTP to a collector this test runs in memory): one request is
one connected trace, its stages children of the gateway's request span, itself a child of the
client's W3C traceparent when one is sent."""

from __future__ import annotations

import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.e2e.cluster import free_port
from tests.e2e.roles import processes, wait_for, workers

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

pytestmark = pytest.mark.slow

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP trace receiver keeping every span in memory, by trace id."""

    def __init__(self) -> None:
        self.spans: dict[str, list[dict]] = defaultdict(list)
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest.FromString(body)
                with collector.lock:
                    for rs in req.resource_spans:
                        service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                        for ss in rs.scope_spans:
                            for sp in ss.spans:
                                collector.spans[sp.trace_id.hex()].append(
                                    {
                                        "service": service,
                                        "name": sp.name,
                                        "id": sp.span_id.hex(),
                                        "parent": sp.parent_span_id.hex(),
                                        "start": sp.start_time_unix_nano,
                                        "end": sp.end_time_unix_nano,
                                    }
                                )
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return list(self.spans.get(trace_id, []))


WANT = {
    ("pdserve-gateway", "gateway.request"),
    ("pdserve-gateway", "gateway.queue"),
    ("pdserve-decode", "decode.reserve"),
    ("pdserve-prefill", "prefill.queue"),
    ("pdserve-prefill", "prefill.compute"),
    ("pdserve-prefill", "kv.transfer"),
    ("pdserve-decode", "decode"),
}


def test_one_connected_trace_across_three_processes(tiny_llama, tmp_path):
    collector = Collector()
    model = str(tiny_llama)
    port, wport = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    common = ["--model", model, "--dtype", "float32", "--num-blocks", "128", "--max-model-len", "256"]
    tracing = ["--otlp-traces-endpoint", collector.url]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export every 0.1 s (default 5 s)
    try:
        with processes(tmp_path) as procs:
            procs.pdserve(
                "gateway", "gateway", "--model", model, "--port", str(port),
                "--worker-bind", f"tcp://127.0.0.1:{wport}", *tracing, env=env,
            )  # fmt: skip
            procs.pdserve("prefill", "prefill", *common, "--gateway", base, *tracing, env=env)
            procs.pdserve("decode", "decode", *common, "--gateway", base, *tracing, env=env)
            wait_for(lambda: len(workers(base)) == 2, 180, "both workers", procs)
            body = {"model": "tiny-llama", "prompt": "a traced request", "max_tokens": 8, "temperature": 0}
            header = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
            assert httpx.post(f"{base}/v1/completions", json=body, headers=header, timeout=60).status_code == 200

            def complete() -> bool:
                return WANT <= {(s["service"], s["name"]) for s in collector.trace(CLIENT_TRACE)}

            wait_for(complete, 20, "every stage's span in the client's trace", procs)
            spans = collector.trace(CLIENT_TRACE)
            (root,) = [s for s in spans if s["name"] == "gateway.request"]
            assert root["parent"] == CLIENT_SPAN  # a child of the caller's span
            for s in spans:
                if s is not root:  # every stage hangs off the request span, whichever process
                    assert s["parent"] == root["id"], s
                    assert root["start"] <= s["start"] <= s["end"]
            assert {s["service"] for s in spans} == {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}

            # without a client traceparent: a trace of its own, as connected
            before = set(collector.spans)
            body["prompt"] = "another one"
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200

            def new_trace() -> list[dict] | None:
                for trace_id in set(collector.spans) - before:
                    got = collector.trace(trace_id)
                    if WANT <= {(s["service"], s["name"]) for s in got}:
                        return got
                return None

            spans = wait_for(new_trace, 20, "the second request's trace", procs)
            (root,) = [s for s in spans if s["name"] == "gateway.request"]
            assert root["parent"] == "" and all(s["parent"] == root["id"] for s in spans if s is not root)
    finally:
        collector.server.shutdown()
