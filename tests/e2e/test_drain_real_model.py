"""Draining on a model of real shape (30 layers, hidden 576, ~115M parameters), where a prompt
of 600-950 tokens takes seconds to prefill, so drains overlap queued prompts and live streams
as they would in production: 2 prefill + 2 decode workers as separate processes, a burst of 8
long-prompt streams; SIGTERM one prefill worker while prompts queue at it (it finishes them and
leaves) and one decode worker with --drain-timeout 3 while it streams (it hands off). Every
stream completes and equals the same prompts served undisturbed afterwards."""

from __future__ import annotations

import concurrent.futures as cf
import signal

import pytest
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.e2e.cluster import free_port
from tests.e2e.roles import processes, stream_text, wait_for, workers

pytestmark = pytest.mark.slow

MAX_NEW = 64


def _holds_work(base: str, pid: int, key: str) -> bool:
    return any(w["pid"] == pid and w["load"][key] > 0 for w in workers(base))


def test_drains_and_hand_off_on_a_real_sized_model(real_llama, tmp_path):
    model = str(real_llama)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = random_prompts(tok.vocab_size, [900, 700, 800, 950, 600, 850, 750, 900], seed=9)
    port, wport = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    common = ["--model", model, "--dtype", "float32", "--max-model-len", "2048", "--num-blocks", "512"]
    name = real_llama.name
    with processes(tmp_path) as procs:
        procs.pdserve(
            "gateway", "gateway", "--model", model, "--port", str(port), "--worker-bind", f"tcp://127.0.0.1:{wport}"
        )
        p1 = procs.pdserve("prefill-1", "prefill", *common, "--gateway", base)
        procs.pdserve("prefill-2", "prefill", *common, "--gateway", base)
        d1 = procs.pdserve("decode-1", "decode", *common, "--gateway", base, "--drain-timeout", "3")
        procs.pdserve("decode-2", "decode", *common, "--gateway", base)
        wait_for(lambda: len(workers(base)) == 4, 300, "4 workers", procs)
        with cf.ThreadPoolExecutor(8) as pool:
            runs = [pool.submit(stream_text, base, p, MAX_NEW, name) for p in prompts]
            wait_for(lambda: _holds_work(base, p1.pid, "waiting") or _holds_work(base, p1.pid, "running"), 120,
                     "prompts at prefill-1", procs)  # fmt: skip
            p1.send_signal(signal.SIGTERM)
            wait_for(lambda: _holds_work(base, d1.pid, "running"), 180, "streams on decode-1", procs)
            d1.send_signal(signal.SIGTERM)
            got = [r.result(timeout=600) for r in runs]
            assert p1.wait(timeout=120) == 0 and "drained; leaving" in procs.log("prefill-1")
            assert d1.wait(timeout=60) == 0 and "drain timed out" in procs.log("decode-1")
            assert "lost worker" in procs.log("gateway")  # decode-1's streams moved on
            assert sorted(w["role"] for w in workers(base)) == ["decode", "prefill"]
            want = list(pool.map(lambda p: stream_text(base, p, MAX_NEW, name), prompts))
        assert got == want
