"""What the gateway's tests share: a small byte-level tokenizer, WorkerInfo for fake workers, a
request flow over a simulated cluster, and a started ClusterBackend with one fake worker's sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from transformers import AutoTokenizer

from pdserve.gateway.admission import AdmissionQueue, QueueLimits
from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.gateway.cluster_members import ClusterMembers
from pdserve.gateway.request_flow import DisaggregatedFlow
from pdserve.gateway.request_record import RequestTable
from pdserve.gateway.router import Router
from pdserve.modelgen.tokenizer_builder import build_tokenizer
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Inbox, Outbox
from pdserve.protocol.messages import KvLayout, Message, WorkerInfo


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, 512)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def fake_worker(worker_id: str, role: str, control_addr: str, num_blocks: int = 8, max_num_seqs: int = 4) -> WorkerInfo:
    """What a worker of `role` at `control_addr` registers with (no engine behind it)."""
    return WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        control_addr=control_addr,
        host="localhost",
        pid=1,
        model_fingerprint="m",
        kv_layout=KvLayout(1, num_blocks, 16, 1, 8, "float32"),
        max_num_seqs=max_num_seqs,
    )


def single_try_flow(members: ClusterMembers, router: Router) -> DisaggregatedFlow:
    """A gateway's request flow over `members`: ZeroMQ KV, one attempt, a failed decode failing."""
    return DisaggregatedFlow(
        members,
        RequestTable(),
        router,
        AdmissionQueue("disaggregated", QueueLimits(), lambda: 4, lambda pool, s: None),
        kv_transport="zmq",
        reserve_timeout_s=5.0,
        on_decode_failure="fail",
        max_attempts=1,
        on_release=lambda: None,
    )


@dataclass
class FakeWorkerLink:
    backend: ClusterBackend
    inbox: Inbox  # what the gateway sends the fake worker
    out: Outbox  # the fake worker's socket to the gateway
    info: WorkerInfo

    async def recv(self, timeout_s: float = 3.0) -> Message | None:
        """The next message for the worker (the gateway's loop runs meanwhile), None if none came."""
        for _ in range(int(timeout_s / 0.02)):
            await asyncio.sleep(0.02)
            msg = self.inbox.recv_one(0)
            if msg is not None:
                return msg
        return None


@contextlib.asynccontextmanager
async def gateway_with_fake_worker(
    tmp_path: Path, auth: FrameAuth, worker_id: str, role: str, **worker: int
) -> AsyncIterator[FakeWorkerLink]:
    """A started ClusterBackend and the two sockets of one fake worker (not yet registered);
    everything closed afterwards, whatever happened."""
    backend = ClusterBackend(auth, f"ipc://{tmp_path}/gw.sock")
    await backend.start()
    ctx = zmq.Context()
    inbox = Inbox(ctx, auth, f"ipc://{tmp_path}/{worker_id}.sock")
    out = Outbox(ctx, auth, backend.inbox_addr)
    try:
        yield FakeWorkerLink(backend, inbox, out, fake_worker(worker_id, role, inbox.addr, **worker))
    finally:
        out.close()
        inbox.close()
        ctx.term()
        await backend.stop()
