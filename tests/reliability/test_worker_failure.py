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


def busy_decode_pid(base: str, wait_s: float = 5.0) -> int | None:
    """PID of the decode worker the gateway routes a request to, from /metrics (the gateway's
    own count: current, unlike worker stats, which lag by up to a heartbeat). Polled for up to
    `wait_s`: the metric lists live workers only, and a busy machine can delay a heartbeat."""
    deadline = time.monotonic() + wait_s
    while True:
        text = urllib.request.urlopen(f"{base}/metrics", timeout=2).read().decode()
        for node, value in re.findall(r'pdserve_worker_requests_routed\{node="(decode-[^"]+)"\} ([0-9.]+)', text):
            if float(value) > 0:
                return int(node.split("-")[-2])
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


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


WORDS = r"[a-z]{1,6}( [a-z]{1,6}){40,80}"  # long enough to kill a worker in the middle of it


def _constrained_stream(base: str, prompt: list[int], kill: list[int] | None) -> tuple[str, str | None]:
    """A greedy stream under a regex constraint; SIGKILL its decode worker after 5 chunks when
    `kill` is given (the pid killed is appended)."""
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=300,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"regex": WORDS}},
    )
    pieces, finish = [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if kill is not None and not kill and len(pieces) >= 5:
            pid = busy_decode_pid(base)
            assert pid is not None, "the gateway routes no request to a decode worker"
            os.kill(pid, signal.SIGKILL)
            kill.append(pid)
    return "".join(pieces), finish


def test_a_constrained_stream_keeps_its_constraint_across_a_killed_decode_worker(real_llama):
    """The migrated request's new decode worker rebuilds the matcher from the tokens generated so
    far (`resumed_tokens`): the stream is the one an undisturbed run gives, and it matches.
    On the real-shape model: the tiny one decodes a whole constrained stream in ~25 ms once its
    grammar is compiled, too quick to kill a worker in the middle of it."""
    tok = AutoTokenizer.from_pretrained(real_llama)
    prompt = random_prompts(tok.vocab_size, [9], seed=8)[0]
    with running_server(real_llama, "--decode-workers", "2") as base:
        want, want_finish = _constrained_stream(base, prompt, None)
        assert re.fullmatch(WORDS, want) and want_finish == "stop"
        killed: list[int] = []
        text, finish = _constrained_stream(base, prompt, killed)
        assert killed and len(want) > 40
        assert (text, finish) == (want, want_finish)


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
