"""Live membership with real processes, each role started on its own as an operator would:
workers join by the gateway's URL (and are refused without the cluster secret), a decode worker
SIGTERM'd mid-stream drains (takes nothing new, finishes what it holds, deregisters, exits 0), a
worker added while traffic runs takes requests, and a drain that times out hands its streams to
a live worker. Every stream equals HF greedy, and every decode worker's KV ledger balances."""

from __future__ import annotations

import concurrent.futures as cf
import secrets
import signal
import time

import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import free_port
from tests.e2e.roles import processes, stream_text, wait_for, workers
from tests.reliability.faults import slow_env

pytestmark = pytest.mark.slow

MAX_NEW = 120
STEP_S = 0.02  # every decode step this much slower: a stream lasts ~2.5 s, long enough to interrupt


def _stream(base: str, prompt: list[int]) -> str:
    return stream_text(base, prompt, MAX_NEW)


def _by_pid(base: str, pid: int) -> dict | None:
    return next((w for w in workers(base) if w["pid"] == pid), None)


def test_join_drain_scale_up_and_hand_off(tiny_llama, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [9, 21, 14, 30, 17, 25], seed=5)
    want = [tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    model = str(tiny_llama)
    port, wport = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    common = ["--model", model, "--dtype", "float32", "--num-blocks", "256", "--max-model-len", "512"]
    slow = slow_env("decode", STEP_S)
    with processes(tmp_path) as procs:
        procs.pdserve(
            "gateway", "gateway", "--model", model, "--port", str(port), "--worker-bind", f"tcp://127.0.0.1:{wport}"
        )
        procs.pdserve("prefill", "prefill", *common, "--gateway", base)  # joins by the URL, before it is up
        a = procs.pdserve("decode-a", "decode", *common, "--gateway", base, env=slow)
        b = procs.pdserve("decode-b", "decode", *common, "--gateway", base, "--drain-timeout", "0.5", env=slow)
        wait_for(
            lambda: len(workers(base)) == 3 and all(w["state"] == "ready" for w in workers(base)),
            180,
            "3 workers",
            procs,
        )

        # without the cluster secret: refused at once, and the gateway says why
        intruder = procs.pdserve(
            "intruder", "decode", *common, "--gateway", base, env={"PDSERVE_CLUSTER_SECRET": secrets.token_hex(32)}
        )
        assert intruder.wait(timeout=60) != 0
        assert "refused to let this decode worker join (403)" in procs.log("intruder")
        wait_for(lambda: "join refused" in procs.log("gateway"), 10, "the gateway's log line")
        assert len(workers(base)) == 3

        with cf.ThreadPoolExecutor(8) as pool:
            # 1. drain: decode-a holds streams when SIGTERM comes; they finish there
            runs = [pool.submit(_stream, base, p) for p in prompts[:4]]
            wait_for(
                lambda: (_by_pid(base, a.pid) or {}).get("load", {}).get("routed_requests", 0) > 0,
                30,
                "a stream on decode-a",
            )
            a.send_signal(signal.SIGTERM)
            wait_for(lambda: _by_pid(base, a.pid)["state"] == "draining", 5, "decode-a draining")
            after = pool.submit(_stream, base, prompts[4])  # sent while it drains: goes to decode-b
            wait_for(
                lambda: (_by_pid(base, b.pid) or {}).get("load", {}).get("routed_requests", 0) > 0,
                10,
                "routing to decode-b",
            )
            assert _by_pid(base, a.pid)["state"] == "draining"
            assert [r.result(timeout=120) for r in runs] == want[:4]
            assert a.wait(timeout=30) == 0  # drained and left on its own
            assert "drained; leaving" in procs.log("decode-a")
            assert after.result(timeout=120) == want[4]
            wait_for(lambda: _by_pid(base, a.pid) is None, 5, "decode-a gone from /v1/workers")

            # 2. scale up while traffic runs: a new decode worker joins and takes requests
            c = procs.pdserve("decode-c", "decode", *common, "--gateway", base)
            wait_for(lambda: (_by_pid(base, c.pid) or {}).get("state") == "ready", 120, "decode-c ready", procs)

            # 3. a drain that times out: decode-b's streams move to decode-c and stay exact
            runs = [pool.submit(_stream, base, p) for p in prompts[:2]]
            wait_for(
                lambda: (_by_pid(base, b.pid) or {}).get("load", {}).get("routed_requests", 0) > 0,
                30,
                "a stream on decode-b",
            )
            time.sleep(0.3)  # some tokens streamed from decode-b
            b.send_signal(signal.SIGTERM)
            assert b.wait(timeout=30) == 0
            assert "drain timed out" in procs.log("decode-b")
            assert [r.result(timeout=120) for r in runs] == want[:2]
            assert "lost worker" in procs.log("gateway")  # migrated, not finished where it began

        # every block of the decode worker left is back: nothing running, nothing leased
        def settled():
            (w,) = [w for w in workers(base) if w["role"] == "decode"]
            return w["kv"]["blocks_used"] == 0 and w["load"]["leases_active"] == 0

        wait_for(settled, 10, "decode-c's KV ledger to settle")
