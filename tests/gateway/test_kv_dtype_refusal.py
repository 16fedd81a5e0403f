"""A prefill or decode worker whose --kv-cache-dtype differs from the workers already serving its
model is refused at join (`Refused`): no pair of them could exchange KV. Colocated workers pair
with nobody, so they join whatever their dtype."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from pdserve.gateway.cluster_members import ClusterMembers
from pdserve.gateway.membership import WorkerEntry, WorkerTable
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.kv_rows import split_fingerprint
from pdserve.protocol.messages import Deregister, Heartbeat, Refused, Register, Welcome, WorkerInfo, WorkerStats
from tests.gateway.conftest import fake_worker, gateway_with_fake_worker

AUTH = FrameAuth(b"k" * 32)
MODEL = "llama/L2/H4/KV2/D16/V300/float32"


def worker(worker_id: str, role: str, kv: str = "auto", model: str = MODEL) -> WorkerInfo:
    suffix = "" if kv == "auto" else f"/kv-{kv}"
    return msgspec.structs.replace(fake_worker(worker_id, role, f"ipc://{worker_id}"), model_fingerprint=model + suffix)


@dataclass
class Plane:
    """The gateway's worker plane, recording what it would send."""

    addr: str = "ipc://gw"
    sent: list[tuple[str, object]] = field(default_factory=list)
    links: set[str] = field(default_factory=set)

    def connected(self, worker_id: str) -> bool:
        return worker_id in self.links

    def connect(self, worker_id: str, control_addr: str) -> None:
        self.links.add(worker_id)

    def disconnect(self, worker_id: str) -> None:
        self.links.discard(worker_id)

    def send(self, worker_id: str, msg: object) -> bool:
        self.sent.append((worker_id, msg))
        return True


def members() -> tuple[ClusterMembers, Plane]:
    plane = Plane()
    return ClusterMembers(plane, "gw", WorkerTable(dead_after_s=60), lambda: None), plane  # type: ignore[arg-type]


def refusals(plane: Plane) -> dict[str, str]:
    return {wid: m.reason for wid, m in plane.sent if isinstance(m, Refused)}


def test_the_fingerprint_names_the_kv_dtype():
    assert split_fingerprint(MODEL) == (MODEL, "auto")
    assert split_fingerprint(MODEL + "/kv-int8") == split_fingerprint(MODEL + "/kv-fp8")[:1] + ("int8",)


def test_a_decode_worker_of_another_kv_dtype_is_refused_and_ignored_after():
    m, plane = members()
    m.on_register_or_heartbeat(Register(info=worker("p-1", "prefill")))
    m.on_register_or_heartbeat(Register(info=worker("d-int8", "decode", "int8")))
    why = refusals(plane)["d-int8"]
    assert "int8" in why and "auto" in why and "p-1" in why
    assert set(m.table.workers) == {"p-1"}
    m.on_register_or_heartbeat(
        Heartbeat(worker_id="d-int8", stats=WorkerStats(), info=worker("d-int8", "decode", "int8"))
    )
    assert set(m.table.workers) == {"p-1"} and len(refusals(plane)) == 1
    plane.sent.clear()
    m.on_register_or_heartbeat(Register(info=worker("d-int8", "decode", "int8")))  # it did not hear: told again
    assert list(refusals(plane)) == ["d-int8"]
    m.on_deregister(Deregister(worker_id="d-int8"))
    assert not plane.connected("d-int8")


def test_workers_that_can_pair_join():
    m, plane = members()
    m.on_register_or_heartbeat(Register(info=worker("d-1", "decode", "int8")))
    m.on_register_or_heartbeat(Register(info=worker("p-1", "prefill", "int8")))
    m.on_register_or_heartbeat(Register(info=worker("d-2", "decode", "int8")))
    m.on_register_or_heartbeat(Register(info=worker("c-1", "colocated")))  # pairs with nobody
    m.on_register_or_heartbeat(Register(info=worker("p-other", "prefill", model=MODEL.replace("L2", "L3"))))
    assert not refusals(plane)
    assert set(m.table.workers) == {"d-1", "p-1", "d-2", "c-1", "p-other"}
    assert sum(isinstance(msg, Welcome) for _, msg in plane.sent) == 5


def test_once_the_other_dtype_is_gone_the_pool_may_change_it():
    m, plane = members()
    m.on_register_or_heartbeat(Register(info=worker("p-1", "prefill")))
    m.on_deregister(Deregister(worker_id="p-1"))
    m.on_register_or_heartbeat(Register(info=worker("d-int8", "decode", "int8")))
    assert not refusals(plane) and set(m.table.workers) == {"d-int8"}
    dead = WorkerEntry(worker("p-dead", "prefill"))
    dead.gone = True  # died without a word: no longer live
    m.table.workers["p-dead"] = dead
    m.on_register_or_heartbeat(Register(info=worker("d-2", "decode", "int8")))
    assert not refusals(plane)


def test_the_refusal_reaches_the_worker_over_its_socket(tmp_path):
    async def scenario() -> object:
        async with gateway_with_fake_worker(tmp_path, AUTH, "decode-int8", "decode") as w:
            w.backend.table.workers["p-1"] = WorkerEntry(worker("p-1", "prefill", model="m"))
            info = msgspec.structs.replace(w.info, model_fingerprint="m/kv-int8")
            assert w.out.send(Register(info=info))
            got = await w.recv(2.0)
            assert "decode-int8" not in w.backend.table.workers
            return got

    got = asyncio.run(scenario())
    assert isinstance(got, Refused) and got.gateway_id.startswith("gw-") and "kv-cache-dtype" in got.reason
