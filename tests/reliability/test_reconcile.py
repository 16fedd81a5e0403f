"""A decode worker forgets a request without a word (a fault hook: the engine aborts it after its
first output, its record goes): the gateway notices from the worker's heartbeats, which no longer
name it, within a few heartbeats, and runs it again (it migrates: prompt + tokens streamed,
prefilled again) so the client gets its whole answer; pdserve_requests_reconciled_total moves,
every KV block comes back, and a stream running beside it is untouched."""

from __future__ import annotations

import concurrent.futures as cf
import re
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.e2e.cluster import running_server
from tests.reliability.faults import drop_env, slow_env

pytestmark = pytest.mark.slow

MAX_NEW = 120


def _stream(base: str, prompt: list[int], first_token: cf.Future | None = None) -> tuple[str, str | None, float]:
    """The streamed text, its finish reason, and seconds from the first token to the end."""
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": True, "min_tokens": MAX_NEW}
    text, finish, first_at = [], None, 0.0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            if not first_at:
                first_at = time.monotonic()
                if first_token is not None:
                    first_token.set_result(None)
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
    return "".join(text), finish, time.monotonic() - first_at


def _metric(base: str, pattern: str) -> list[float]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return [float(v) for v in re.findall(pattern + r" ([0-9.e+-]+)", text)]


def test_a_request_its_decode_worker_forgot_is_reconciled(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    other, victim = random_prompts(tok.vocab_size, [12, 9], seed=21)
    # every decode step 20 ms longer (streams last seconds), and the decode worker's 2nd request dropped
    env = {**slow_env("decode", 0.02), **drop_env("decode", 2)}
    with running_server(tiny_llama, env=env) as base:
        with cf.ThreadPoolExecutor(2) as pool:
            started: cf.Future = cf.Future()
            beside = pool.submit(_stream, base, other, started)
            started.result(timeout=60)  # the other stream is the decode worker's 1st request
            t0 = time.monotonic()
            dropped = pool.submit(_stream, base, victim)
            text, finish, _ = dropped.result(timeout=60)
            took = time.monotonic() - t0
            beside_text, beside_finish, _ = beside.result(timeout=60)
        assert finish == "length" and took < 20, (finish, took)  # its answer, within a few heartbeats
        assert _metric(base, r'pdserve_requests_reconciled_total\{outcome="migrated"\}') == [1.0]
        # the answers are the ones an undisturbed server gives (greedy): asked again now
        again_victim, _, _ = _stream(base, victim)
        again_other, _, _ = _stream(base, other)
        assert text == again_victim
        assert beside_finish == "length" and beside_text == again_other
        deadline = time.monotonic() + 10  # every block back (cached ones count as free), per heartbeat
        while True:
            free = _metric(base, r'pdserve_kv_blocks_free\{node="(?:decode|prefill)-[^"]+"\}')
            total = _metric(base, r'pdserve_kv_blocks_total\{node="(?:decode|prefill)-[^"]+"\}')
            if (free and free == total) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert free and free == total, (free, total)


def test_a_request_its_colocated_worker_forgot_ends_with_a_clear_error(tiny_llama):
    """Colocated: nothing to move it to, so the stream ends with an error event naming what
    happened, within a few heartbeats, and the next request is served."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    (prompt,) = random_prompts(tok.vocab_size, [9], seed=22)
    env = {**slow_env("colocated", 0.02), **drop_env("colocated", 1)}
    with running_server(tiny_llama, "--colocated", env=env) as base:
        body = {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": True, "min_tokens": MAX_NEW}
        t0, errors = time.monotonic(), []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = httpx.Response(200, content=line[6:]).json()
                    if "error" in chunk:
                        errors.append(chunk["error"])
        assert time.monotonic() - t0 < 20
        assert len(errors) == 1 and "no longer holds the request" in errors[0]["message"], errors
        assert _metric(base, r'pdserve_requests_reconciled_total\{outcome="failed"\}') == [1.0]
        text, finish, _ = _stream(base, prompt)  # served again, whole
        assert finish == "length" and text
