"""The OpenAI HTTP layer against a stub backend: shapes, validation, streaming, aborts."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.gateway.app import create_app
from pdserve.gateway.limits import GatewayLimits
from tests.gateway.stub_backend import StubBackend

MAX_LEN = 64


@pytest.fixture
def backend():
    return StubBackend()


def client_for(backend, tokenizer, **kw):
    app = create_app(
        backend,
        tokenizer,
        model_name="m",
        max_model_len=MAX_LEN,
        limits=kw.pop("limits", GatewayLimits(max_body_bytes=4096)),
        **kw,
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def run(coro):
    return asyncio.run(coro)


async def post(backend, tokenizer, path, body, **kw):
    async with client_for(backend, tokenizer, **kw) as c:
        if isinstance(body, (bytes, str)):
            return await c.post(path, content=body, headers={"content-type": "application/json"})
        return await c.post(path, json=body)


def sse_events(text: str) -> list:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 500}, "max_tokens"),  # over the context
        ({"prompt": "hi", "n": 99}, "n"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": [1, 2, 99999]}, "prompt"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "seed": 2**70}, "seed"),
        ({"prompt": "hi", "stop": ["a"] * 40}, "stop"),
        ({"prompt": "hi", "stop": ["x" * 1000]}, "stop"),
        ({"prompt": 12}, "prompt"),
    ],
)
def test_invalid_parameters_get_400_envelope(backend, tokenizer, body, param):
    r = run(post(backend, tokenizer, "/v1/completions", body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert backend.started == []


def test_malformed_json_unknown_model_and_oversized_body(backend, tokenizer):
    r = run(post(backend, tokenizer, "/v1/completions", b"{not json"))
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = run(post(backend, tokenizer, "/v1/completions", {"model": "other", "prompt": "hi"}))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = run(post(backend, tokenizer, "/v1/completions", {"prompt": "x" * 10_000}))
    assert r.status_code == 413


def test_api_key_checked_before_the_body(backend, tokenizer):
    async def go():
        async with client_for(backend, tokenizer, api_key="sekret") as c:
            bad = await c.post("/v1/completions", json={"prompt": "hi"})
            good = await c.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"Authorization": "Bearer sekret"}
            )
            health = await c.get("/health")
            return bad, good, health

    bad, good, health = run(go())
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert good.status_code == 200 and health.status_code == 200


def test_completion_shape_usage_and_server_side_ids(backend, tokenizer):
    r = run(post(backend, tokenizer, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4}))
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-") and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == tokenizer.decode([5, 6, 7, 5])
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert backend.finished == [body["id"]]


def test_streaming_chat_format(backend, tokenizer):
    body = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = run(post(backend, tokenizer, "/v1/chat/completions", body))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert "pdserve_timings" in usage and usage["pdserve_timings"]["kv_bytes"] == 1024.0
    finishes = [c["finish_reason"] for e in events[1:-2] for c in e["choices"]]
    assert finishes[-1] == "length"


def test_n_choices_with_distinct_seeds(backend, tokenizer):
    r = run(
        post(
            backend,
            tokenizer,
            "/v1/completions",
            {"prompt": [5, 6], "max_tokens": 2, "n": 3, "seed": 10, "temperature": 0.7},
        )
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    (sp,) = backend.sampling.values()  # one request: its members draw with seeds 10, 11, 12
    assert (sp.n, sp.seed) == (3, 10)
    assert body["usage"]["completion_tokens"] == 6
    assert [c["text"] for c in body["choices"]] == [tokenizer.decode([5 + c, 6 + c]) for c in range(3)]


def test_stop_string_truncates_and_aborts_upstream(backend, tokenizer):
    ids = tokenizer.encode("the server the model the cache")
    r = run(post(backend, tokenizer, "/v1/completions", {"prompt": ids, "max_tokens": 40, "stop": ["model"]}))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == "the server the "
    assert len(backend.aborted) == 1


def test_a_stop_string_in_one_choice_stops_that_member_alone_upstream(backend, tokenizer):
    ids = tokenizer.encode("the server the model the cache and the queue")
    texts = [tokenizer.decode([t + c for t in ids]) for c in range(2)]  # what the stub's choices say
    stop = next(texts[1][k : k + 3] for k in range(4, len(texts[1])) if texts[1][k : k + 3] not in texts[0])
    body = {"prompt": ids, "max_tokens": len(ids), "n": 2, "stop": [stop]}
    r = run(post(backend, tokenizer, "/v1/completions", body))
    first, second = r.json()["choices"]
    assert (first["finish_reason"], first["text"]) == ("length", texts[0])
    assert second["finish_reason"] == "stop" and stop not in second["text"]
    assert list(backend.stopped.values()) == [{1}]  # that member was stopped at its worker
    assert backend.aborted == [] and len(backend.finished) == 1  # the other ran to its end


def test_logprobs_shapes(backend, tokenizer):
    r = run(post(backend, tokenizer, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 2}))
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 2
    assert lp["text_offset"][0] == 0 and len(lp["top_logprobs"][0]) == 2
    r = run(
        post(
            backend,
            tokenizer,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 1},
        )
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 1 and "bytes" in content[0]


def test_backend_unavailable_is_503_with_retry_after(backend, tokenizer):
    backend.unavailable = True
    r = run(post(backend, tokenizer, "/v1/completions", {"prompt": "hi"}))
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "server_error"


def test_health_metrics_and_models(backend, tokenizer):
    async def go():
        async with client_for(backend, tokenizer) as c:
            await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
            ok = await c.get("/health")
            backend.healthy = False
            down = await c.get("/health")
            # readiness is one notion: not ready, /v1/models and requests are 503 too (OpenAI envelope)
            refused = [
                await c.get("/v1/models"),
                await c.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}),
            ]
            backend.healthy = True
            return ok, down, refused, await c.get("/metrics"), await c.get("/v1/models")

    ok, down, refused, metrics, models = run(go())
    assert ok.status_code == 200 and down.status_code == 503
    for r in (down, *refused):
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "not_ready" and r.json()["error"]["type"] == "server_error"
    assert down.json()["status"] == "unavailable" and "live_workers" in down.json()
    text = metrics.text
    for name in (
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_time_per_output_token_seconds_count",
        "pdserve_e2e_request_latency_seconds_count",
        'pdserve_kv_blocks_free{node="stub-0"} 7.0',
        'pdserve_kv_blocks_total{node="stub-0"} 10.0',
        "pdserve_num_requests_running",
        "pdserve_ttft_breakdown_seconds_count",
    ):
        assert name in text, name
    assert models.json()["data"][0]["id"] == "m"


def test_concurrent_requests_all_finish(backend, tokenizer):
    backend.delay_s = 0.001

    async def go():
        async with client_for(backend, tokenizer) as c:
            rs = await asyncio.gather(
                *[c.post("/v1/completions", json={"prompt": [5 + i], "max_tokens": 5}) for i in range(20)]
            )
            return rs

    rs = run(go())
    assert all(r.status_code == 200 for r in rs)
    assert len(backend.finished) == 20 and backend.aborted == []


def test_request_timeout_aborts_upstream(backend, tokenizer):
    backend.delay_s = 0.02  # 50 tokens would take ~1 s
    limits = GatewayLimits(max_body_bytes=4096, request_timeout_s=0.15)
    r = run(post(backend, tokenizer, "/v1/completions", {"prompt": [5, 6], "max_tokens": 50}, limits=limits))
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    r = run(
        post(backend, tokenizer, "/v1/completions", {"prompt": [5, 6], "max_tokens": 50, "stream": True}, limits=limits)
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and "timed out" in events[-2]["error"]["message"]
    assert len(backend.aborted) == 2 and backend.finished == []


def test_full_queue_is_429_with_retry_after(backend, tokenizer):
    from pdserve.gateway.admission import QueueFull

    backend.refusal = QueueFull("the decode queue is full", retry_after_s=4)
    r = run(post(backend, tokenizer, "/v1/completions", {"prompt": "hi"}))
    assert r.status_code == 429 and r.headers["retry-after"] == "4"
    assert r.json()["error"]["code"] == "queue_full"


def test_unknown_path_and_wrong_method_get_envelopes(backend, tokenizer):
    async def go():
        async with client_for(backend, tokenizer) as c:
            return await c.get("/v1/nope"), await c.get("/v1/completions")

    missing, wrong = run(go())
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert "allow" in {k.lower() for k in wrong.headers}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format",
        ),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),  # past the vocabulary
    ],
)
def test_nothing_is_ignored_silently(backend, tokenizer, path, body, param):
    r = run(post(backend, tokenizer, path, body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert backend.started == []


def test_logit_bias_reaches_the_sampler_and_harmless_defaults_pass(backend, tokenizer):
    r = run(
        post(
            backend,
            tokenizer,
            "/v1/completions",
            {"prompt": [5, 6], "max_tokens": 2, "logit_bias": {"7": -100, "3": 2.5}, "user": "u1"},
        )
    )
    assert r.status_code == 200, r.text
    assert backend.sampling[backend.started[0]].logit_bias == ((3, 2.5), (7, -100.0))
    r = run(
        post(
            backend,
            tokenizer,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
                "tools": [],
                "tool_choice": "none",
                "response_format": {"type": "text"},
            },
        )
    )
    assert r.status_code == 200, r.text


def test_chat_template_file_and_models_root(backend, tokenizer):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"

    async def go():
        app = create_app(
            backend, tokenizer, model_name="m", max_model_len=MAX_LEN, chat_template=template, model_root="/models/m"
        )
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            chat = await c.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            )
            return chat, await c.get("/v1/models")

    chat, models = run(go())
    assert chat.status_code == 200, chat.text
    assert backend.prompts[backend.started[0]] == tokenizer.encode("<user>hi", add_special_tokens=False)
    assert models.json()["data"][0]["root"] == "/models/m"
