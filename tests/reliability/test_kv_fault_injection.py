"""KV frames dropped, delayed, truncated, corrupted or replayed on their way from a prefill worker to
a decode worker (zmq tcp): each fault has one expected outcome, and afterwards every worker's KV
ledger balances and a canary request is served.

Real processes on loopback: gateway, one prefill and one decode worker (`python -m pdserve.cli
<role>`, one cluster secret), the decode worker's KV inbox behind the fault-injection relay of
tests/reliability/kv_relay.py (`--kv-advertise` = the relay). The lease TTL is short (3 s) so
the "later than the lease" case stays quick. The first tests run the receiver in-process, to
show what the payload MAC stops (and that without it a tampered payload would land).

The planes run unencrypted here (PDSERVE_PLANE_ENCRYPTION=off), so the relay can read and alter
frames: these tests check what the MACs catch beneath the encryption. With it on (the default
over TCP) a relay without the secret cannot even complete the handshake
(tests/protocol/test_plane_encryption.py)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import zmq

from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import ZmqKvSender
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDone
from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import free_port
from tests.reliability.kv_relay import Fault, KvRelay, flip_payload
from tests.reliability.ledger import assert_canary_served, wait_ledger_balanced

pytestmark = pytest.mark.slow

LEASE_TTL_S = 3.0
MAX_NEW = 6
HTTP_TIMEOUT_S = LEASE_TTL_S + 15  # a request that outlives this has hung


# --- in-process: the receiver with and without payload authentication ---------------------------
def _tampered_transfer(receiver_mac: bool, sender_mac: bool = True) -> tuple[dict, bool, list]:
    """One 1-layer, 2-block transfer whose payload bits are flipped on the way (a relay without
    the secret). Returns (dropped reasons, whether the tampered bytes landed, KvDones accepted)."""
    auth = FrameAuth(b"s" * 32, encryption="off")  # the relay must see the frames (module docstring)
    ctx = zmq.Context()
    try:
        dst = torch.zeros(1, 2, 4, 4, 2, 8)  # [L, 2, N, bs, Hkv, D]
        leases = LeaseTable(1)
        with KvReceiver(ctx, auth, "tcp://127.0.0.1:0", dst, leases, payload_mac=receiver_mac) as receiver:
            relay = KvRelay("tcp://127.0.0.1:0", receiver.addr)
            relay.start()
            relay.arm(Fault("corrupt"))
            sender = ZmqKvSender(ctx, auth, relay.addr, payload_mac=sender_mac)
            try:
                lease = leases.grant("r", [1, 2], ttl_s=30)
                src = torch.full((2, 2, 4, 2, 8), 0.5)
                sent = sender.send_layer("r", lease, 0, src, [0, 1], [1, 2])
                sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=1, kv_bytes=sent))
                done, deadline = [], time.monotonic() + 5
                while not done and not receiver.dropped and time.monotonic() < deadline:
                    done += receiver.poll(50)
                done += receiver.poll(200)
            finally:
                sender.close()
                relay.stop()
            assert [a.action for a in relay.applied] == ["corrupt"]
            landed = bool((dst[0, :, [1, 2]] != 0).any()) and not bool((dst[0, :, [1, 2]] == 0.5).all())
            return dict(receiver.dropped), landed, done
    finally:
        ctx.destroy(linger=0)


def test_payload_mac_rejects_a_tampered_payload_before_it_lands():
    dropped, landed, done = _tampered_transfer(receiver_mac=True)
    assert dropped == {"payload_mac": 1, "incomplete": 1} and not landed and done == []


def test_without_payload_mac_a_tampered_payload_lands():
    """The gap the payload MAC closes (and proof the check above can fail)."""
    dropped, landed, done = _tampered_transfer(receiver_mac=False)
    assert dropped == {} and landed and [d.request_id for d in done] == ["r"]


def test_receiver_requiring_payload_mac_refuses_untagged_frames():
    dropped, landed, _ = _tampered_transfer(receiver_mac=True, sender_mac=False)
    assert dropped == {"payload_mac_missing": 1, "incomplete": 1} and not landed


def test_flip_payload_changes_every_float():
    values = torch.linspace(0.01, 100, 32)
    data = torch.cat([values, -values]).numpy().tobytes()
    flipped = torch.frombuffer(bytearray(flip_payload(data)), dtype=torch.float32)
    assert len(flip_payload(data)) == len(data)
    assert bool((flipped.abs() > 1e18).sum() + (flipped.abs() < 1e-18).sum() == 64)


# --- real processes through the relay -------------------------------------------------------------
@dataclass
class Cluster:
    base: str
    relay: KvRelay
    procs: dict[str, subprocess.Popen]
    logs: dict[str, Path]
    model: Path

    def log(self, role: str) -> str:
        return self.logs[role].read_text(errors="replace")


def _wait_healthy(base: str, procs: dict[str, subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        dead = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"processes exited early: {dead}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not become healthy")
        time.sleep(0.25)


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _warm_up(base: str, timeout_s: float = 60.0) -> None:
    """One request end to end before any test: a cold first prefill (thread pools, first matmuls)
    can outlast the short lease TTL used here on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
        if r.status_code == 200:
            wait_ledger_balanced(base, timeout_s=LEASE_TTL_S + 4)
            return
    raise TimeoutError(f"no request went through the relay cluster within {timeout_s}s")


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("kv-relay")
    http, gw_inbox, kv_port = free_port(), free_port(), free_port()
    relay = KvRelay("tcp://127.0.0.1:0", f"tcp://127.0.0.1:{kv_port}")
    relay.start()
    env = dict(
        os.environ,
        PDSERVE_CLUSTER_SECRET=secrets.token_hex(32),
        PDSERVE_LOG_LEVEL="INFO",
        PDSERVE_PLANE_ENCRYPTION="off",  # the relay must see the frames (module docstring)
    )
    engine = [
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--num-blocks",
        "128",
        "--max-model-len",
        "256",
        "--threads",
        "1",
        "--gateway",
        f"tcp://127.0.0.1:{gw_inbox}",
        # every request's KV must cross the relay: no prompt may be served from a cache (the
        # tests reuse their prompts, and a decode worker holding one would skip the transfer)
        "--no-enable-prefix-caching",
    ]
    argv = {
        "gateway": [
            "gateway",
            "--model",
            str(tiny_llama),
            "--port",
            str(http),
            "--kv-transport",
            "zmq",
            "--worker-bind",
            f"tcp://127.0.0.1:{gw_inbox}",
            "--max-model-len",
            "256",
            "--local-prefill-max-tokens",
            "0",
        ],
        "prefill": ["prefill", *engine],
        "decode": [
            "decode",
            *engine,
            "--no-shm",
            "--lease-ttl",
            str(LEASE_TTL_S),
            "--kv-bind",
            f"tcp://127.0.0.1:{kv_port}",
            "--kv-advertise",
            relay.addr,
        ],
    }
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    try:
        for role, args in argv.items():
            logs[role] = tmp / f"{role}.log"
            with open(logs[role], "wb") as out:
                procs[role] = subprocess.Popen(
                    [sys.executable, "-m", "pdserve.cli", *args],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        base = f"http://127.0.0.1:{http}"
        _wait_healthy(base, procs, timeout_s=120)
        _warm_up(base)
        yield Cluster(base, relay, procs, logs, tiny_llama)
    finally:
        _stop(procs)
        relay.stop()


@dataclass
class Outcome:
    status: int
    text: str
    error: str | None  # the OpenAI error message (envelope or stream error event)
    done: bool  # streaming: "data: [DONE]" came
    seconds: float


def complete(base: str, prompt: list[int], stream: bool = False) -> Outcome:
    body = {"prompt": prompt, "max_tokens": MAX_NEW, "min_tokens": MAX_NEW, "temperature": 0, "stream": stream}
    t0 = time.monotonic()
    with httpx.Client(base_url=base, timeout=HTTP_TIMEOUT_S) as client:
        if not stream:
            r = client.post("/v1/completions", json=body)
            data = r.json()
            error = data["error"]["message"] if "error" in data else None
            text = "" if error else data["choices"][0]["text"]
            return Outcome(r.status_code, text, error, False, time.monotonic() - t0)
        text, error, done = "", None, False
        with client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    error = event["error"]["message"]
                else:
                    text += "".join(c["text"] for c in event["choices"])
            return Outcome(r.status_code, text, error, done, time.monotonic() - t0)


def expected(model: Path, prompt: list[int]) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return tok.decode(hf_greedy(str(model), tuple(prompt), MAX_NEW, MAX_NEW), skip_special_tokens=True)


def decode_dropped(base: str) -> float:
    """The decode worker's dropped-frames counter (from its heartbeats, in the gateway's /metrics)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=2).read().decode()
    found = re.findall(r'pdserve_dropped_frames\{node="decode[^"]*"\} ([0-9.e+]+)', text)
    assert len(found) == 1, text
    return float(found[0])


def wait_dropped(base: str, at_least: float, timeout_s: float = 5.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (n := decode_dropped(base)) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def assert_healthy_after(c: Cluster) -> None:
    """The checks every scenario ends with: nothing held back, ledger balanced, canary served."""
    deadline = time.monotonic() + 10
    while not c.relay.idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.relay.idle and c.relay.error is None
    wait_ledger_balanced(c.base, timeout_s=LEASE_TTL_S + 4)
    assert_canary_served(c.base)
    assert all(p.poll() is None for p in c.procs.values()), {n: p.returncode for n, p in c.procs.items()}


def assert_failed_cleanly(out: Outcome, stream: bool) -> None:
    assert out.error and "KV transfer" in out.error, out
    if stream:
        assert out.status == 200 and out.done, out  # an error event, then [DONE]
    else:
        assert out.status == 500, out  # OpenAI error envelope
    # at once, when P's KvDone finds frames missing: not at the lease deadline (30 s by default)
    assert out.seconds < LEASE_TTL_S - 1, f"took {out.seconds:.1f} s"


PROMPTS = random_prompts(512, [40, 23, 57, 31], seed=5)


def test_passthrough_relay_serves_like_hf(cluster):
    before = cluster.relay.forwarded
    out = complete(cluster.base, PROMPTS[0])
    assert out.status == 200 and out.text == expected(cluster.model, PROMPTS[0]), out
    assert cluster.relay.forwarded >= before + 3  # 2 layer frames + KvDone went through the relay
    assert f"advertised {cluster.relay.addr}, payload mac True" in cluster.log("decode")  # auto: on for tcp
    assert_healthy_after(cluster)


@pytest.mark.parametrize("stream", [False, True])
def test_dropped_frame_fails_that_request_only(cluster, stream):
    c = cluster
    c.relay.arm(Fault("drop", skip=1))  # the target's layer-1 frame never arrives
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: complete(c.base, p, stream), PROMPTS))
    applied = c.relay.done_with()
    assert [a.action for a in applied] == ["drop"]
    failed = [i for i, o in enumerate(outs) if o.error is not None]
    assert len(failed) == 1, outs
    assert_failed_cleanly(outs[failed[0]], stream)
    for i, out in enumerate(outs):
        if i not in failed:
            assert out.status == 200 and out.text == expected(c.model, PROMPTS[i]), out
    assert "(incomplete," in c.log("decode")
    assert_healthy_after(c)


def test_delay_below_the_lease_ttl_changes_nothing(cluster):
    c = cluster
    c.relay.arm(Fault("delay", delay_s=LEASE_TTL_S / 4))
    out = complete(c.base, PROMPTS[1], stream=True)
    applied = c.relay.done_with()
    assert {a.what for a in applied} == {"layer 0 seq 0", "layer 1 seq 1", "KvDone"}
    assert out.status == 200 and out.error is None and out.done, out
    assert out.text == expected(c.model, PROMPTS[1]) and out.seconds >= LEASE_TTL_S / 4
    assert_healthy_after(c)


def test_delay_beyond_the_lease_ttl_is_rejected(cluster):
    c = cluster
    dropped = decode_dropped(c.base)
    c.relay.arm(Fault("delay", delay_s=LEASE_TTL_S + 1.5))
    out = complete(c.base, PROMPTS[2])
    applied = c.relay.done_with()
    assert out.status == 500 and "lease deadline" in (out.error or ""), out
    assert LEASE_TTL_S - 0.5 < out.seconds < LEASE_TTL_S + 1.5, out.seconds
    assert len(applied) == 3
    # the late layer frames arrive after the lease ended: both refused (never written), counted
    assert wait_dropped(c.base, dropped + 2, timeout_s=LEASE_TTL_S + 5) >= dropped + 2
    assert "(unknown_lease," in c.log("decode")
    assert_healthy_after(c)


def test_truncated_frame_is_rejected_and_counted(cluster):
    c = cluster
    dropped = decode_dropped(c.base)
    c.relay.arm(Fault("truncate"))
    out = complete(c.base, PROMPTS[3])
    assert [a.action for a in c.relay.done_with()] == ["truncate"]
    assert_failed_cleanly(out, stream=False)
    # the short frame fails the frame MAC (it binds the payload length), then KvDone is incomplete
    assert wait_dropped(c.base, dropped + 2) >= dropped + 2
    assert "(auth," in c.log("decode")
    assert_healthy_after(c)


def test_corrupted_payload_is_rejected_by_the_payload_mac(cluster):
    c = cluster
    dropped = decode_dropped(c.base)
    c.relay.arm(Fault("corrupt", frames=2))  # every layer's payload tampered, headers intact
    out = complete(c.base, PROMPTS[0], stream=True)
    assert [a.action for a in c.relay.done_with()] == ["corrupt", "corrupt"]
    assert_failed_cleanly(out, stream=True)
    assert wait_dropped(c.base, dropped + 3) >= dropped + 3  # 2 tampered frames + the incomplete KvDone
    assert "(payload_mac," in c.log("decode")
    assert_healthy_after(c)


def test_replayed_frame_is_rejected_and_the_request_succeeds(cluster):
    c = cluster
    dropped = decode_dropped(c.base)
    c.relay.arm(Fault("replay"))
    out = complete(c.base, PROMPTS[1])
    assert [a.action for a in c.relay.done_with()] == ["replay"]
    assert out.status == 200 and out.text == expected(c.model, PROMPTS[1]), out
    assert wait_dropped(c.base, dropped + 1) == dropped + 1
    assert "(duplicate," in c.log("decode")
    assert_healthy_after(c)
