"""Constrained outputs through HTTP with the official openai client, 1P1D (P samples the first
token under the constraint, D rebuilds the matcher) and colocated: json_schema, streamed and not,
plus guided_regex / guided_choice as vLLM's extra body; every output validates."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tests.e2e.conftest import tiny_llama_server
from tests.e2e.metrics_delta import delta, settled_metrics
from tests.engine.test_structured_output import SCHEMA

pytestmark = pytest.mark.slow

MODES = {"1P1D": [], "colocated": ["--colocated"]}  # (serve's default: 1 prefill + 1 decode worker)
FORMAT = {"type": "json_schema", "json_schema": {"name": "stage", "schema": SCHEMA, "strict": True}}


@pytest.fixture(params=list(MODES))
def server(request) -> Iterator[str]:
    """Each mode's server, shared with the package's other tests (tests/e2e/conftest.py)."""
    with tiny_llama_server(request, *MODES[request.param]) as base:
        yield base


def test_json_schema_outputs_validate(server):
    base = server
    before = settled_metrics(
        base,
        "pdserve_structured_mask_rows_total",
        "pdserve_structured_mask_seconds_total",
        "pdserve_structured_requests_total",
    )
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "describe a stage"}]
    for seed in range(3):
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            response_format=FORMAT,
            max_tokens=200,
            seed=seed,  # type: ignore[arg-type]
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            response_format=FORMAT,
            max_tokens=200,
            seed=seed,
            stream=True,  # type: ignore[arg-type]
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    r2 = client.completions.create(
        model=model, prompt="x", max_tokens=20, n=2, seed=4, extra_body={"guided_regex": r"[a-c]{2,5}-[0-9]"}
    )
    assert all(re.fullmatch(r"[a-c]{2,5}-[0-9]", c.text) for c in r2.choices), r2.choices
    r3 = client.completions.create(
        model=model, prompt="x", max_tokens=20, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert r3.choices[0].text in ("yes", "no")
    with pytest.raises(BadRequestError, match="guided_regex"):
        client.completions.create(model=model, prompt="x", extra_body={"guided_regex": "[a-"})
    # what the masks cost, per worker, in the gateway's /metrics (from heartbeats: polled until
    # every worker's has come: the prefill worker's alone counts one row per request)
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{base}/metrics", timeout=5).text
        rows = delta(before, text, "pdserve_structured_mask_rows_total")
        if rows >= 3 * 2 * 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rows >= 3 * 2 * 3 and delta(before, text, "pdserve_structured_mask_seconds_total") > 0
    assert delta(before, text, 'pdserve_structured_requests_total{kind="json_schema"}') == 6


def test_a_hundred_and_fifty_sampled_requests_all_validate(server):
    """A random-weight model, so the grammar alone must guarantee it: 150 sampled json_schema
    requests at once (nested objects, an array, an enum, bounds, additionalProperties false), each
    through the server, every answer parses and validates."""
    import concurrent.futures as cf

    base = server
    body = {"model": "m", "messages": [{"role": "user", "content": "a stage"}], "response_format": FORMAT}
    model = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]

    def one(seed: int) -> dict:
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={**body, "model": model, "seed": seed, "temperature": 1.0, "max_tokens": 200},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with cf.ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(one, range(150)))
    for c in choices:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    assert len({c["message"]["content"] for c in choices}) > 50  # sampled: they differ
