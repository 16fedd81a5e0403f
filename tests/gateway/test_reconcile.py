"""gateway/reconcile.py: a request none of its workers names for MISSED_ROUNDS rounds of fresh
heartbeat snapshots is lost; a named one, a busy worker (no fresh snapshot), a lease while the
request is still at its prefill worker, and a worker that does not tell are judged as they should;
the ClusterBackend ends the attempt of a lost one, and heartbeats carry what its worker holds."""

from __future__ import annotations

import asyncio

from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.output_stream import OutputStream
from pdserve.gateway.reconcile import MISSED_ROUNDS, RequestForgotten, forgotten
from pdserve.gateway.request_record import RequestRecord
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Heartbeat, WorkerStats
from pdserve.protocol.sampling import SamplingParams
from tests.gateway.conftest import fake_worker


def _record(state: str, prefill: WorkerEntry | None, decode: WorkerEntry) -> RequestRecord:
    rec = RequestRecord("r", [1, 2], SamplingParams(max_tokens=8), OutputStream())
    rec.begin_attempt()
    rec.hold(prefill, decode)
    rec.state = state  # type: ignore[assignment]
    return rec


def _report(w: WorkerEntry, held: list[str], leased: list[str] = ()) -> None:  # type: ignore[assignment]
    w.held, w.leased, w.snapshot = frozenset(held), frozenset(leased), w.snapshot + 1


def _rounds(rec: RequestRecord, workers: list[WorkerEntry], held: list[str], leased=(), n: int = 1) -> list:
    lost = []
    for _ in range(n):
        for w in workers:
            _report(w, held, list(leased) if w.info.role == "decode" else [])
        lost = forgotten([rec])
    return lost


def test_a_request_named_nowhere_for_three_fresh_rounds_is_lost():
    async def run():
        d = WorkerEntry(fake_worker("d", "decode", "ipc://d"))
        rec = _record("decoding", None, d)
        _report(d, [])
        assert forgotten([rec]) == []  # the first snapshot seen never counts (it may predate the request)
        assert _rounds(rec, [d], [], n=MISSED_ROUNDS - 1) == []
        assert forgotten([rec]) == []  # the same snapshot again (a busy loop): no round
        assert _rounds(rec, [d], []) == [rec]
        # named again: the count starts over
        rec2 = _record("decoding", None, d)
        forgotten([rec2])
        assert _rounds(rec2, [d], [], n=MISSED_ROUNDS - 1) == []
        assert _rounds(rec2, [d], ["r"]) == [] and rec2.missed_rounds == 0
        assert _rounds(rec2, [d], [], n=MISSED_ROUNDS - 1) == []

    asyncio.run(run())


def test_a_lease_names_a_request_only_once_its_prefill_worker_let_it_go():
    async def run():
        p = WorkerEntry(fake_worker("p", "prefill", "ipc://p"))
        d = WorkerEntry(fake_worker("d", "decode", "ipc://d"))
        rec = _record("prefilling", p, d)
        _report(p, [])
        _report(d, ["r"], ["r"])
        forgotten([rec])  # (the first snapshots seen)
        # P forgot it, D holds only its lease: nobody will write it
        for _ in range(MISSED_ROUNDS - 1):
            _report(p, [])
            _report(d, ["r"], ["r"])
            assert forgotten([rec]) == []
        _report(p, [])
        _report(d, ["r"], ["r"])
        assert forgotten([rec]) == [rec]
        # P names it (queued, or handed over a moment ago): fine, whatever D says
        rec2 = _record("prefilling", p, d)
        forgotten([rec2])
        assert _rounds(rec2, [p, d], ["r"], ["r"], n=2 * MISSED_ROUNDS) == []
        # its first token came (decoding): D's lease (KV on its way) names it
        rec3 = _record("decoding", p, d)
        forgotten([rec3])
        for _ in range(2 * MISSED_ROUNDS):
            _report(d, ["r"], ["r"])
            assert forgotten([rec3]) == []
        # a round needs a fresh snapshot from every watched worker: a busy D stops the count
        rec4 = _record("prefilling", p, d)
        forgotten([rec4])
        for _ in range(2 * MISSED_ROUNDS):
            _report(p, [])
            assert forgotten([rec4]) == []

    asyncio.run(run())


def test_a_worker_that_does_not_tell_is_never_judged():
    async def run():
        d = WorkerEntry(fake_worker("d", "decode", "ipc://d"))
        rec = _record("decoding", None, d)
        for _ in range(2 * MISSED_ROUNDS):
            d.snapshot += 1
            assert forgotten([rec]) == []

    asyncio.run(run())


def test_the_backend_ends_a_forgotten_attempt_from_heartbeats(tmp_path):
    async def run() -> BaseException | None:
        backend = ClusterBackend(FrameAuth(b"s" * 32), f"ipc://{tmp_path}/gw.sock")
        backend.plane.connect = lambda *a: None  # type: ignore[method-assign]
        backend.plane.connected = lambda *a: True  # type: ignore[method-assign]
        backend.plane.send = lambda *a: None  # type: ignore[method-assign]
        info = fake_worker("d", "decode", "ipc://d")

        def beat(snapshot: int, held: list[str]) -> None:
            backend._dispatch(
                Heartbeat(worker_id="d", stats=WorkerStats(), info=info, requests=held, snapshot=snapshot, via="gw")
            )

        beat(1, [])
        d = backend.table.workers["d"]
        rec = _record("decoding", None, d)
        backend.requests.add(rec)
        beat(2, ["r"])
        for n in range(3, 3 + MISSED_ROUNDS + 1):
            backend.check_liveness()
            beat(n, [])
            beat(n, [])  # a repeat of the same snapshot tells nothing new
        backend.check_liveness()
        assert rec.outcome is not None and rec.outcome.done()
        return rec.outcome.exception()

    error = asyncio.run(run())
    assert isinstance(error, RequestForgotten) and error.worker_ids == ["d"]
