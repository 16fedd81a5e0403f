"""`pdserve serve` 1P1D with a tensor-parallel degree per pool: real processes on
loopback, greedy output == HF generate (fp32) token for token while the KV crosses between
degrees (re-sliced by KV head), a prefix-cache hit on a repeated prompt, every block back after."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.roles import wait_for, workers
from tests.engine.tensor_parallel_models import single_kv_head_qwen2
from tests.reliability.test_worker_failure import busy_decode_pid

MAX_NEW = 16
LENGTHS = [7, 30, 65, 12]


def rank_pids(pid: int) -> list[int]:
    """The tensor-parallel rank processes (ranks 1..N-1) worker `pid` started."""
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if b"pdserve.engine.parallel.worker" in Path(f"/proc/{c}/cmdline").read_bytes()]


def shm_segments(pid: int) -> set[str]:
    """The pdserve shared-memory segments process `pid` maps (KV pools: its own, or written into)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in lines if "/dev/shm/pdserve-" in line}


def settled(base: str) -> bool:
    """Every worker's blocks are back (cached ones count as free) and no lease is open."""
    ws = workers(base)
    return len(ws) == 2 and all(w["kv"]["blocks_used"] == 0 and w["load"]["leases_active"] == 0 for w in ws)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,p,d,budget,transport",
    [
        ("tiny_llama", 2, 1, 512, "shm"),
        ("tiny_llama", 1, 2, 512, "shm"),
        ("tiny_llama", 2, 2, 24, "shm"),
        ("tiny_llama", 2, 2, 24, "zmq-ipc"),
        ("one_kv_head", 2, 2, 512, "shm"),
    ],
)
def test_1p1d_with_a_degree_per_pool_matches_hf(request, models_dir, family, p, d, budget, transport):
    """tiny Llama: 4 q heads over 2 KV heads (GQA), one KV head per rank at degree 2. Each prefill
    rank sends its own heads (its own senders). Over shared memory they are written in place into
    every decode rank pool holding them (D advertises one segment per rank: each sending prefill
    rank maps each of them); over ZeroMQ D takes one frame per prefill rank and layer and
    re-slices it by rank.
    Qwen2 with one KV head: replicated on both ranks of each pool (one write, both D ranks get it).
    `budget` 24: prompts prefilled in chunks (a partly filled block re-sent with the next chunk)."""
    if family == "one_kv_head":
        model = single_kv_head_qwen2(models_dir / "tiny-qwen2-1kv")
    else:
        model = request.getfixturevalue(family)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = random_prompts(tok.vocab_size, LENGTHS, seed=36)
    want = [tok.decode(hf_greedy(str(model), tuple(x), MAX_NEW), skip_special_tokens=True) for x in prompts]
    flags = ["--prefill-tensor-parallel-size", str(p), "--decode-tensor-parallel-size", str(d)]
    flags += ["--prefill-max-num-batched-tokens", str(budget), "--kv-transport", transport]
    with running_server(model, *flags, timeout_s=300) as base:
        degrees = {w["role"]: len(rank_pids(w["pid"])) + 1 for w in workers(base)}
        assert degrees == {"prefill": p, "decode": d}
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id

        def complete(x):
            r = client.completions.create(model=name, prompt=x, max_tokens=MAX_NEW, temperature=0)
            return r.choices[0].text

        def stream(x):
            chunks = client.completions.create(model=name, prompt=x, max_tokens=MAX_NEW, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with cf.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: batched prefill and decode steps
            assert list(pool.map(complete, prompts)) == want
            assert list(pool.map(stream, prompts)) == want
        again = client.completions.create(model=name, prompt=prompts[2], max_tokens=MAX_NEW, temperature=0)
        assert again.choices[0].text == want[2]
        assert again.usage.prompt_tokens_details.cached_tokens >= 48  # its 4 full blocks of 16, computed before
        wait_for(lambda: settled(base), 15, "every KV block back on both workers")
        pid = {w["role"]: w["pid"] for w in workers(base)}
        decode_pools = shm_segments(pid["decode"])  # rank 0 maps every rank's pool; its own too over shm
        assert len(decode_pools) == (d if transport == "shm" else d - 1)
        written = shm_segments(pid["prefill"]) & decode_pools  # the decode pools the prefill worker maps
        assert written == (decode_pools if transport == "shm" else set())
        # each prefill rank sends its own heads: rank 1 maps the decode pools too (over shm), unless
        # its one KV head is rank 0's as well (replicated: the lowest rank holding a head sends it)
        own_heads = family != "one_kv_head"
        for rank in rank_pids(pid["prefill"]):
            assert shm_segments(rank) & decode_pools == (decode_pools if transport == "shm" and own_heads else set())


@pytest.mark.slow
def test_a_decode_rank_killed_mid_stream_migrates_the_stream_and_the_worker_restarts_whole(tiny_llama):
    """SIGKILL of rank 1 of the decode worker serving a stream: rank 0's next collective fails at
    once, the worker leaves, the gateway migrates the stream to the other TP-2 decode worker
    (whose ranks take the KV re-sliced), and the text equals HF's with no token lost or repeated.
    Then `serve`'s supervisor restarts the broken worker whole (rank 0 and its rank 1, the old
    ones all gone) and it serves again."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = random_prompts(tok.vocab_size, [9], seed=5)[0]
    n = 300
    want = tok.decode(hf_greedy(str(tiny_llama), tuple(prompt), n, n), skip_special_tokens=True)
    # round-robin: after the restart, requests rotate over both decode workers (the default router
    # may keep sending a burst of short ones to the worker that was already there)
    flags = ["--decode-workers", "2", "--decode-tensor-parallel-size", "2", "--router", "round-robin"]
    with running_server(tiny_llama, *flags, timeout_s=300) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        chunks = client.completions.create(
            model=name, prompt=prompt, max_tokens=n, temperature=0, stream=True, extra_body={"min_tokens": n}
        )
        pieces, finish, killed = [], None, []
        for chunk in chunks:
            if not chunk.choices:
                continue
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            if not killed and len(pieces) >= 5:
                pid = busy_decode_pid(base)
                assert pid is not None, "the gateway routes no request to a decode worker"
                (rank1,) = rank_pids(pid)
                survivors = [w["pid"] for w in workers(base) if w["role"] == "decode" and w["pid"] != pid]
                survivors += [r for w in survivors for r in rank_pids(w)]
                old_ranks = [pid, rank1]
                os.kill(rank1, signal.SIGKILL)
                killed.append(pid)
                killed_at = len(pieces)
        assert killed and finish == "length"
        assert "".join(pieces) == want
        assert len(pieces) - killed_at > n // 2  # most of the stream came after the kill: migrated
        wait_for(lambda: killed[0] not in [w["pid"] for w in workers(base)], 30, "the broken worker to leave")
        # the supervisor restarts the logical worker whole: a new rank 0 with its own rank 1, and
        # nothing of the old one left running (no orphaned rank waiting in a collective)
        wait_for(lambda: sum(w["role"] == "decode" for w in workers(base)) == 2, 60, "the restarted worker")
        fresh = [w["pid"] for w in workers(base) if w["role"] == "decode" and w["pid"] not in survivors]
        assert len(fresh) == 1 and len(rank_pids(fresh[0])) == 1
        wait_for(lambda: not any(running(p) for p in old_ranks), 30, "the old worker's ranks to end")
        fresh_prompts = random_prompts(tok.vocab_size, [11, 23, 17, 30], seed=6)
        fresh_want = [
            tok.decode(hf_greedy(str(tiny_llama), tuple(x), 24), skip_special_tokens=True) for x in fresh_prompts
        ]

        def complete(x):
            return client.completions.create(model=name, prompt=x, max_tokens=24, temperature=0).choices[0].text

        with cf.ThreadPoolExecutor(len(fresh_prompts)) as pool:
            assert list(pool.map(complete, fresh_prompts)) == fresh_want
        took = lambda: {w["pid"]: w["load"]["steps"] for w in workers(base)}.get(fresh[0], 0) > 0  # noqa: E731
        wait_for(took, 10, "the restarted worker to report steps (it took traffic)")  # heartbeats lag
        wait_for(lambda: settled_all(base), 15, "every KV block back")


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def settled_all(base: str) -> bool:
    return all(w["kv"]["blocks_used"] == 0 and w["load"]["leases_active"] == 0 for w in workers(base))


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--prefill-tensor-parallel-size", "3"], "does not divide the model's 4 attention heads"),
        (["--colocated", "--decode-tensor-parallel-size", "2"], "a colocated worker takes --tensor-parallel-size"),
        (["--prefill-tensor-parallel-size", "2", "--prefill-idle-lanes", "1"], "runs one lane"),
    ],
)
def test_serve_refuses_pool_degrees_it_cannot_run(tiny_llama, flags, message):
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama), "--port", "0", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
