"""Workers without a model, for measuring the gateway alone (bench/gateway_cpu.py): they speak the
real worker protocol (Register, Heartbeat, ReserveReply, TokenOutput, TokenOutputBatch) and
produce tokens at once, so the gateway is the only process doing work per token.

`python -m pdserve.bench.stub_workers MODE GATEWAY_ADDR RUN_DIR` with MODE
- `disaggregated`: a prefill worker P and a decode worker D in one process. D grants every
  reservation; P answers a PrefillRequest with the first token (index 0) and hands the request
  to D, which sends the rest, one token per request per step, as one TokenOutputBatch a step.
- `colocated`: one colocated worker sending every token, one TokenOutputBatch a step.
Each step is `STEP_S` apart, as a real decode worker's are. It prints `ready` once registered
and runs until killed. Tokens are a fixed cycle of ordinary ids, so every run detokenizes the same.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import zmq

from pdserve.protocol.auth import FrameAuth, load_cluster_secret
from pdserve.protocol.channel import Inbox, Outbox
from pdserve.protocol.messages import (
    Abort,
    GenerateRequest,
    Heartbeat,
    KvLayout,
    Lease,
    PrefillRequest,
    Register,
    ReserveReply,
    ReserveRequest,
    TokenOutput,
    TokenOutputBatch,
    WorkerInfo,
    WorkerStats,
)

STEP_S = 0.005  # between two decode steps
TOKENS = list(range(40, 140))  # the cycle of output token ids
LAYOUT = KvLayout(1, 1 << 16, 16, 1, 8, "float32")
STATS = WorkerStats(kv_blocks_free=1 << 16, kv_blocks_total=1 << 16)


@dataclass
class _Running:
    request_id: str
    next_index: int
    max_tokens: int


def _info(worker_id: str, role: str, inbox: Inbox) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        control_addr=inbox.addr,
        host="localhost",
        pid=os.getpid(),
        model_fingerprint="stub",
        kv_layout=LAYOUT,
        kv_addr=inbox.addr if role == "decode" else None,
        max_num_seqs=4096,
    )


def _token(index: int) -> int:
    return TOKENS[index % len(TOKENS)]


def run(mode: str, gateway_addr: str, run_dir: str) -> None:
    auth = FrameAuth(load_cluster_secret())
    ctx = zmq.Context()
    out = Outbox(ctx, auth, gateway_addr)
    roles = ["prefill", "decode"] if mode == "disaggregated" else ["colocated"]
    inboxes = {role: Inbox(ctx, auth, f"ipc://{run_dir}/stub-{role}.sock") for role in roles}
    infos = {role: _info(f"stub-{role}", role, box) for role, box in inboxes.items()}
    stepper = infos["decode" if mode == "disaggregated" else "colocated"].worker_id
    for info in infos.values():
        out.send(Register(info=info, via=gateway_addr))
    print("ready", flush=True)
    poller = zmq.Poller()
    for box in inboxes.values():
        poller.register(box.socket, zmq.POLLIN)
    running: dict[str, _Running] = {}
    epoch = 0
    next_beat = next_step = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= next_beat:
            for info in infos.values():
                out.send(Heartbeat(worker_id=info.worker_id, stats=STATS, info=info, via=gateway_addr))
            next_beat = now + 0.5
        if now >= next_step:
            if running:
                batch = []
                for r in list(running.values()):
                    last = r.next_index == r.max_tokens - 1
                    batch.append(
                        TokenOutput(
                            request_id=r.request_id,
                            worker_id=stepper,
                            index=r.next_index,
                            token_ids=[_token(r.next_index)],
                            finish_reason="length" if last else None,
                        )
                    )
                    r.next_index += 1
                    if last:
                        del running[r.request_id]
                out.send(TokenOutputBatch(outputs=batch))
            next_step = now + STEP_S
        timeout_ms = max(0.0, min(next_beat, next_step) - time.monotonic()) * 1000
        for sock, _ in poller.poll(int(timeout_ms)):
            box = next(b for b in inboxes.values() if b.socket is sock)
            for msg in box.recv():
                if isinstance(msg, ReserveRequest):
                    epoch += 1
                    lease = Lease(epoch=epoch, block_ids=[], deadline=time.time() + 600, ttl_s=600)
                    out.send(ReserveReply(request_id=msg.request_id, worker_id=msg.to_worker, lease=lease))
                elif isinstance(msg, PrefillRequest):  # the first token from P, the rest from D
                    max_tokens = msg.sampling.max_tokens
                    first = TokenOutput(
                        request_id=msg.request_id,
                        worker_id=infos["prefill"].worker_id,
                        index=0,
                        token_ids=[_token(0)],
                        finish_reason="length" if max_tokens == 1 else None,
                        timings={"prefill_queue_s": 0.0},
                    )
                    out.send(first)
                    if max_tokens > 1:
                        running[msg.request_id] = _Running(msg.request_id, 1, max_tokens)
                elif isinstance(msg, GenerateRequest):
                    running[msg.request_id] = _Running(msg.request_id, 0, msg.sampling.max_tokens)
                elif isinstance(msg, Abort) and msg.seq_index is None:
                    running.pop(msg.request_id, None)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3])
