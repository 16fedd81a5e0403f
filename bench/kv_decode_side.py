"""bench-kv's decode side in a process of its own, as a decode worker is: the receivers, their
lease table and the pool, so the prefill side's sends never wait on their GIL.

The parent (`DecodeSide`) starts `python -m pdserve.bench.kv_transfer --decode-side` (configured
as a worker is, with the parent's `--contiguous-copy`: pdserve/worker_process.py) and speaks line-delimited JSON over its stdin/stdout:

    -> {"secret": hex, "pool": name, "shape": [...], "dtype": "float32", "threads": T,
        "transports": {name: {"bind": addr, "encryption": mode, "payload_mac": bool}}}
    <- {"addrs": {name: addr}}
    -> {"op": "grant", "transport": name, "request_id": rid, "block_ids": [...]}
    <- {"lease": {...}}                       (protocol.messages.Lease as JSON)
    <- {"done": rid, "at": t, "dropped": n}   (t: time.perf_counter() when D accepted the KvDone;
                                               CLOCK_MONOTONIC, the same clock in both processes)
    -> {"op": "quit"}

Only bench data crosses the pipe (no pickle); the KV itself goes over the transport measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import IO

import msgspec
import torch
import zmq

from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.kvtransfer.wire import torch_dtype
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Lease

START_TIMEOUT_S = 60.0


class DecodeSide:
    """The parent's handle on the decode-side process."""

    def __init__(
        self, secret: bytes, pool: SharedTensor, threads: int, transports: dict[str, dict], contiguous_copy: str
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.bench.kv_transfer",
                "--decode-side",
                "--contiguous-copy",
                contiguous_copy,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            self._send(
                {
                    "secret": secret.hex(),
                    "pool": pool.name,
                    "shape": list(pool.shape),
                    "dtype": str(pool.dtype).removeprefix("torch."),
                    "threads": threads,
                    "transports": transports,
                }
            )
            self.addrs: dict[str, str] = self._read("addrs")
        except BaseException:
            self.close()
            raise
        self.dropped: dict[str, int] = {name: 0 for name in transports}

    def grant(self, transport: str, request_id: str, block_ids: list[int]) -> Lease:
        self._send({"op": "grant", "transport": transport, "request_id": request_id, "block_ids": block_ids})
        return msgspec.convert(self._read("lease"), Lease)

    def wait_done(self, transport: str, request_id: str) -> float:
        """When D accepted `request_id`'s KvDone (perf_counter); the lease is released there."""
        line = self._line()
        if line.get("done") != request_id:
            raise RuntimeError(f"bench-kv decode side: expected {request_id!r} done, got {line}")
        self.dropped[transport] = line["dropped"]
        return float(line["at"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self.proc.wait(10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def _send(self, obj: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _line(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench-kv decode side exited (code {self.proc.wait()})")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"bench-kv decode side: {out['error']}")
        return out

    def _read(self, key: str):
        line = self._line()
        if key not in line:
            raise RuntimeError(f"bench-kv decode side: expected {key!r}, got {line}")
        return line[key]


def serve_decode_side(stdin: IO[str] = sys.stdin, stdout: IO[str] = sys.stdout) -> int:
    """The child: receive into the shared pool until told to quit."""

    def say(obj: dict) -> None:
        stdout.write(json.dumps(obj) + "\n")
        stdout.flush()

    setup = json.loads(stdin.readline())
    torch.set_num_threads(setup["threads"])
    secret = bytes.fromhex(setup["secret"])
    pool = SharedTensor.attach(setup["pool"], tuple(setup["shape"]), torch_dtype(setup["dtype"]))
    assert pool.tensor is not None
    ctx = zmq.Context()
    receivers: dict[str, tuple[KvReceiver, LeaseTable]] = {}
    try:
        for name, t in setup["transports"].items():
            leases = LeaseTable(pool.shape[0])
            auth = FrameAuth(secret, encryption=t["encryption"])
            receivers[name] = (
                KvReceiver(ctx, auth, t["bind"], pool.tensor, leases, payload_mac=t["payload_mac"]),
                leases,
            )
        say({"addrs": {name: r.addr for name, (r, _) in receivers.items()}})
        poller = zmq.Poller()
        poller.register(stdin.fileno(), zmq.POLLIN)
        by_socket = {}
        for name, (r, _) in receivers.items():
            poller.register(r.socket, zmq.POLLIN)
            by_socket[r.socket] = name
        while True:
            for sock, _ in poller.poll():
                if sock in by_socket:
                    receiver, leases = receivers[by_socket[sock]]
                    for done in receiver.poll(0, max_frames=1 << 30):
                        at = time.perf_counter()
                        leases.release(done.request_id)
                        say({"done": done.request_id, "at": at, "dropped": sum(receiver.dropped.values())})
                    continue
                cmd = json.loads(stdin.readline() or '{"op": "quit"}')
                if cmd["op"] == "quit":
                    return 0
                _, leases = receivers[cmd["transport"]]
                lease = leases.grant(cmd["request_id"], cmd["block_ids"], ttl_s=120)
                say({"lease": msgspec.to_builtins(lease)})
    except Exception as e:  # reported to the parent, which raises it
        say({"error": f"{type(e).__name__}: {e}"})
        return 1
    finally:
        for r, _ in receivers.values():
            r.close()
        pool.close()
        ctx.destroy(linger=0)
