"""`pdserve serve` keeps the cluster secret it is given: a decode worker started by hand with the
same secret joins the running `serve` by its URL, takes streams, and drains on SIGTERM (before,
serve replaced the secret with a random one and the worker was refused with 403). One whose
--kv-cache-dtype differs from serve's workers' is refused at join and exits with status 1."""

from __future__ import annotations

import concurrent.futures as cf
import signal

import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import free_port
from tests.e2e.roles import processes, stream_text, wait_for, workers
from tests.reliability.faults import slow_env

pytestmark = pytest.mark.slow

MAX_NEW = 80


def test_a_hand_started_worker_joins_serve_takes_streams_and_drains(tiny_llama, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [11, 23, 17, 29], seed=7)
    want = [tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    model, port = str(tiny_llama), free_port()
    base = f"http://127.0.0.1:{port}"
    common = ["--model", model, "--dtype", "float32", "--num-blocks", "256", "--max-model-len", "512"]
    slow = slow_env("decode", 0.02)  # streams last ~2 s: long enough to be held at SIGTERM
    with processes(tmp_path) as procs:  # every process gets the same PDSERVE_CLUSTER_SECRET
        procs.pdserve("serve", "serve", *common, "--port", str(port), env=slow)
        wait_for(lambda: len(workers(base)) == 2, 180, "serve's 2 workers", procs)
        # a decode worker whose KV could not pair with serve's prefill worker is refused and stops
        int8 = procs.pdserve("decode-int8", "decode", *common, "--kv-cache-dtype", "int8", "--gateway", base)
        assert int8.wait(timeout=120) == 1
        assert "refused this decode worker: its --kv-cache-dtype is int8" in procs.log("decode-int8")
        assert len(workers(base)) == 2
        hand = procs.pdserve("decode-hand", "decode", *common, "--gateway", base, env=slow)
        wait_for(
            lambda: any(w["pid"] == hand.pid and w["state"] == "ready" for w in workers(base)),
            120,
            "the hand-started worker",
            procs,
        )

        def on_hand() -> int:
            w = next((w for w in workers(base) if w["pid"] == hand.pid), None)
            return w["load"]["routed_requests"] if w else 0

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            runs = [pool.submit(stream_text, base, p, MAX_NEW) for p in prompts]  # a burst spreads
            wait_for(lambda: on_hand() > 0, 30, "a stream on the hand-started worker")
            hand.send_signal(signal.SIGTERM)
            assert [r.result(timeout=120) for r in runs] == want
        assert hand.wait(timeout=30) == 0  # drained and left on its own
        assert "drained; leaving" in procs.log("decode-hand")
