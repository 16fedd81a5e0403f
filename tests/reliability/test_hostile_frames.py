"""Garbage, pickle and wrongly-signed frames on every internal socket: dropped, counted, no
code runs, and the cluster keeps serving."""

from __future__ import annotations

import hashlib
import hmac
import pickle
import re
import time
import urllib.request

import pytest
import zmq
from openai import OpenAI

from tests.e2e.cluster import running_server

pytestmark = pytest.mark.slow


class _Trap:
    """Unpickling this creates a file: proof that something unpickled attacker data."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def hostile_messages(marker: str) -> list[list[bytes]]:
    evil = pickle.dumps(_Trap(marker))
    wrong_mac = hmac.new(b"not-the-cluster-secret!!", b"\x00", hashlib.sha256).digest()
    return [
        [evil],  # a bare pickle
        [b"\x00" * 32, evil],  # pickle where the header goes, junk mac
        [wrong_mac, b"\x81\xa4type\xa5Abort"],  # plausible msgpack, wrong secret
        [b"garbage"] * 5,
        [b""],
    ]


def dropped_by_node(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=2).read().decode()
    return {n: float(v) for n, v in re.findall(r'pdserve_dropped_frames\{node="([^"]+)"\} ([0-9.e+]+)', text)}


def test_hostile_frames_on_every_internal_port(tiny_llama, tmp_path):
    marker = tmp_path / "pwned"
    with running_server(tiny_llama, env={"TMPDIR": str(tmp_path)}) as base:
        (run_dir,) = tmp_path.glob("pdserve-*")
        sockets = sorted(run_dir.glob("*.sock"))
        assert {p.name for p in sockets} >= {"gateway.sock", "prefill-0.sock", "decode-0.sock", "decode-0-kv.sock"}
        ctx = zmq.Context()
        try:
            for path in sockets:
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 1000)
                push.connect(f"ipc://{path}")
                for frames in hostile_messages(str(marker)):
                    push.send_multipart(frames)
                push.close()
        finally:
            ctx.term()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            dropped = dropped_by_node(base)
            if len(dropped) >= 3 and all(v >= 5 for v in dropped.values()):
                break
            time.sleep(0.2)
        assert len(dropped) >= 3 and all(v >= 5 for v in dropped.values()), dropped
        assert not marker.exists(), "a pickle payload was executed"
        assert urllib.request.urlopen(f"{base}/health", timeout=2).status == 200
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=client.models.list().data[0].id, prompt=[5, 6, 7], max_tokens=5)
        assert r.usage.completion_tokens >= 1
