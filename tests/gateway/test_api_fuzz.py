"""Fuzz the HTTP API against its own OpenAPI document (GET /openapi.json) with schemathesis.

Each operation gets schemathesis's coverage cases (every field at and past its bounds, of a wrong
type, left out; other methods), then random valid and invalid requests from Hypothesis with a fixed
seed. Every answer must not be a 5xx; must match the documented status codes, content types,
headers and schemas (each stream event included); must refuse a body the document calls invalid;
and, when it is an error, must be an OpenAI error envelope. Schemathesis reads at most 20 events of
a stream and then hangs up, so client disconnects get exercised too.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi import checks as openapi
from starlette.testclient import TestClient

from pdserve.gateway.app import create_app
from pdserve.gateway.limits import GatewayLimits
from tests.e2e.cluster import running_server
from tests.gateway.stub_backend import StubBackend
from tests.reliability.ledger import assert_canary_served, wait_ledger_balanced

GENERATING = {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages"}
OPERATIONS = GENERATING | {
    "POST /v1/messages/count_tokens",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /health",
    "GET /metrics",
}
CONFIG = schemathesis.Config.from_dict(
    {
        "output": {"sanitization": {"enabled": False}},  # show fields named *token* in failures too
        # How the gateway refuses an invalid body: 400, 404 for another model, 413 for one too big.
        "checks": {"negative_data_rejection": {"expected-statuses": ["400", "404", "413"]}},
    }
)


def error_envelope(ctx, response, case) -> bool | None:
    """An error answer is exactly {"error": {"message", "type", "param", "code"}}; Anthropic's
    Messages API's is {"type": "error", "error": {"type", "message"}}."""
    if response.status_code < 400 or case.path == "/health":  # /health's 503 is its status report
        return None
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert list(body) == ["type", "error"] and body["type"] == "error", body
        assert sorted(body["error"]) == ["message", "type"] and body["error"]["message"], body
        return True
    assert list(body) == ["error"], body
    err = body["error"]
    assert sorted(err) == ["code", "message", "param", "type"], err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")), err
    return True


# Random cases (valid and invalid) per operation, after its coverage cases, which already send
# every field at and past its bounds, of a wrong type and left out (~4,100 cases in all).
RANDOM_EXAMPLES = 50

CHECKS = [
    not_a_server_error,
    openapi.status_code_conformance,
    openapi.content_type_conformance,
    openapi.response_headers_conformance,
    openapi.response_schema_conformance,
    openapi.negative_data_rejection,
    error_envelope,
]


def fuzz(schema, examples: int, record_property, operations: set[str] = OPERATIONS, **call_kwargs) -> None:
    """Send and check each of `operations`' coverage cases, then `examples` random ones (valid and
    invalid); assert that each operation got them all."""
    sent: Counter = Counter()

    def send(case) -> None:
        case.call_and_validate(checks=CHECKS, **call_kwargs)
        sent[case.operation.label] += 1

    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        if op.label not in operations:
            continue
        config = schema.config.generation_for(operation=op, phase="coverage")
        for case in schema.iter_coverage_cases(op, generation_modes=list(GenerationMode), generation_config=config):
            send(case)
        cases = st.one_of([op.as_strategy(generation_mode=mode) for mode in GenerationMode])
        # No shrinking: a failure is reported as found (with a curl line), in bounded time.
        settings(
            max_examples=examples,
            derandomize=True,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(given(cases)(send))()
    record_property("fuzz_cases", dict(sent))
    print(f"{sum(sent.values())} cases in {time.monotonic() - t0:.1f} s: {dict(sent)}")
    assert set(sent) == operations, sent
    # The generating bodies' coverage cases alone are several hundred; the GETs have a few.
    floor = {op: examples + 200 if op in GENERATING else examples if op.startswith("POST") else 2 for op in operations}
    assert all(sent[op] >= floor[op] for op in operations), sent


def test_fuzz_in_process(tokenizer, record_property):
    backend = StubBackend()
    # A small body cap so that some generated bodies get the 413.
    app = create_app(
        backend,
        tokenizer,
        model_name="m",
        max_model_len=64,
        limits=GatewayLimits(max_body_bytes=8192),
        tool_call_parser="hermes",  # tools read and forced (gateway/tools/)
    )
    fuzz(schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG), RANDOM_EXAMPLES, record_property)
    # Every request ended, and closed its backend streams.
    assert app.state.gateway.in_flight == 0
    assert set(backend.started) <= set(backend.finished) | set(backend.aborted)


def test_openapi_document_follows_the_limits_and_needs_no_api_key(tokenizer):
    app = create_app(
        StubBackend(), tokenizer, model_name="m", max_model_len=64, limits=GatewayLimits(max_n=3), api_key="sekret"
    )
    with TestClient(app) as client:
        doc = client.get("/openapi.json")
        assert client.get("/v1/models").status_code == 401
    assert doc.status_code == 200 and doc.json()["openapi"] == "3.1.0"
    n = doc.json()["components"]["schemas"]["ChatCompletionRequest"]["properties"]["n"]
    assert n == {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3}, {"type": "null"}]}


@pytest.mark.slow
def test_fuzz_cluster_serves_on_and_leaks_no_kv_block(tiny_llama, record_property):
    """Over HTTP against `pdserve serve` (1 prefill + 1 decode worker): the operations that reach
    the workers (the others answer from the gateway alone, as fuzzed in process); a short context
    keeps each request's generation short."""
    with running_server(tiny_llama, "--max-model-len", "64") as base:
        fuzz(
            schemathesis.openapi.from_url(f"{base}/openapi.json", config=CONFIG),
            RANDOM_EXAMPLES // 2,
            record_property,
            GENERATING,
            timeout=60,
        )
        wait_ledger_balanced(base)
        metrics = httpx.get(f"{base}/metrics").text
        assert re.search(r"^pdserve_gateway_requests_in_flight 0\.0$", metrics, re.M)
        assert_canary_served(base)


# --- what the fuzzing found -------------------------------------------------------------------
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path,body,param",
    [
        # 500: a chat prompt filling the context left max_tokens (its default, the rest) at <= 0
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 100}]}, "max_tokens"),
        # crashed the worker's sampler (torch.tensor overflow); the gateway then had no prefill worker
        ("/v1/completions", {"prompt": "hi", "top_k": 2**63}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),  # no msgpack int
        # accepted though invalid
        ("/v1/completions", {"prompt": "hi", "echo": 0}, "echo"),
        ("/v1/completions", {"prompt": "hi", "suffix": 0}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "best_of": True}, "best_of"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2, "max_tokens": "x"}, "max_tokens"),
    ],
)
def test_found_bodies_get_a_400(tokenizer, path, body, param):
    app = create_app(StubBackend(), tokenizer, model_name="m", max_model_len=64)
    with TestClient(app) as client:
        r = client.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_token_ids_may_be_whole_floats_as_other_integers(tokenizer):
    app = create_app(StubBackend(), tokenizer, model_name="m", max_model_len=64)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": [5.0, 6], "max_tokens": 2, "stop_token_ids": [9.0]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2, r.text


def test_a_stream_the_client_leaves_is_no_longer_in_flight(tokenizer):
    """Hanging up mid-stream left pdserve_gateway_requests_in_flight one higher for good: the
    stream's cleanup awaited in a cancelled scope before counting the request done."""
    backend = StubBackend()
    backend.delay_s = 0.01
    app = create_app(backend, tokenizer, model_name="m", max_model_len=64)
    body = json.dumps({"prompt": [5, 6], "max_tokens": 50, "stream": True}).encode()
    request = [{"type": "http.request", "body": body}]
    sent = []

    async def receive():
        if request:
            return request.pop()
        await asyncio.sleep(0.1)  # a few tokens in
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    assert any(m.get("more_body") for m in sent)  # it was streaming when the client left
    assert app.state.gateway.in_flight == 0 and backend.aborted
