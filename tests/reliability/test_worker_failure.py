"""SIGKILL of a decode worker mid-stream: the request migrates and the stream is exact."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server

pytestmark = pytest.mark.slow

N = 500  # tokens (the tiny model's context is 512)


def busy_decode_pid(base: str) -> int | None:
    """PID of the decode worker the gateway routes a request to, from /metrics (the gateway's
    own count: current, unlike worker stats, which lag by up to a heartbeat)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=2).read().decode()
    for node, value in re.findall(r'pdserve_worker_requests_routed\{node="(decode-[^"]+)"\} ([0-9.]+)', text):
        if float(value) > 0:
            return int(node.split("-")[-2])
    return None


def stream_killing_decode(base: str, prompt: list[int], killed_pids: list[int]):
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=N, temperature=0, stream=True, extra_body={"min_tokens": N}
    )
    pieces, finish = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if not killed_pids and len(pieces) >= 5:
            pid = busy_decode_pid(base)
            assert pid is not None, "the gateway routes no request to a decode worker"
            os.kill(pid, signal.SIGKILL)
            killed_pids.append(pid)
    return "".join(pieces), finish


def test_decode_worker_killed_mid_stream_migrates_exactly(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = random_prompts(tok.vocab_size, [9], seed=5)[0]
    want = tok.decode(hf_greedy(str(tiny_llama), tuple(prompt), N, N), skip_special_tokens=True)
    with running_server(tiny_llama, "--decode-workers", "2") as base:
        killed: list[int] = []
        text, finish = stream_killing_decode(base, prompt, killed)
        assert killed
        assert finish == "length"
        assert text == want  # no duplicate or missing tokens across the migration
        # the survivor still serves, and every KV block comes back on the live workers
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt[:4], max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(f"{base}/metrics", timeout=2).read().decode()
            free = dict(re.findall(r'pdserve_kv_blocks_free\{node="([^"]+)"\} ([0-9.]+)', text))
            total = dict(re.findall(r'pdserve_kv_blocks_total\{node="([^"]+)"\} ([0-9.]+)', text))
            if free and free == total:
                break
            time.sleep(0.3)
        assert free == total, f"KV blocks not all free: {free} vs {total}"


def test_decode_failure_policy_fail_ends_with_error(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = random_prompts(tok.vocab_size, [9], seed=6)[0]
    with running_server(tiny_llama, "--on-decode-failure", "fail") as base:
        import openai

        killed: list[int] = []
        with pytest.raises(openai.APIError) as err:
            stream_killing_decode(base, prompt, killed)
        assert killed, "the stream ended before a decode worker was killed"
        assert not isinstance(err.value, openai.APIStatusError)  # an error event mid-stream, not a refusal
        assert "stopped responding" in str(err.value)
