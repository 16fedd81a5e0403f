"""A reservation the gateway gave up on must not answer a later one (the first structured request
on a fresh 1P1D server hung: docs/reliability.md). The decode worker took the first ask late (it
built its grammar tokenizer meanwhile), the gateway had timed out, aborted it and asked again; the
late "local" answer to the first ask resolved the second, and the abort then cut off the only run
of the request: its stream waited forever. Now the attempt goes on under a new worker id after an
ask is abandoned, so the late answer and the stale run's tokens find no record, and the late take
is handed back."""

from __future__ import annotations

import asyncio

from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.output_stream import OutputStream
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Abort, ReserveReply, ReserveRequest, TokenOutput, WorkerStats
from pdserve.protocol.sampling import SamplingParams
from tests.gateway.conftest import fake_worker


def test_a_late_answer_to_an_abandoned_reservation_answers_nothing(tmp_path):
    async def run() -> tuple[list[tuple[str, object]], list[TokenOutput]]:
        backend = ClusterBackend(
            FrameAuth(b"s" * 32), f"ipc://{tmp_path}/gw.sock", reserve_timeout_s=0.2, prefill_placement="auto"
        )
        sent: list[tuple[str, object]] = []
        backend.plane.send = lambda worker_id, msg: sent.append((worker_id, msg))  # type: ignore[method-assign]
        backend.table.dead_after_s = 60
        p = WorkerEntry(fake_worker("p-1", "prefill", "ipc://p", num_blocks=256))
        d = WorkerEntry(fake_worker("d-1", "decode", "ipc://d", num_blocks=256), WorkerStats(kv_blocks_free=256))
        backend.table.workers.update({"p-1": p, "d-1": d})

        async def reservation(n: int) -> ReserveRequest:
            for _ in range(500):
                asks = [m for _, m in sent if isinstance(m, ReserveRequest)]
                if len(asks) >= n:
                    return asks[n - 1]
                backend._notify_queues()  # (the gateway's 1 s ticker, sooner)
                await asyncio.sleep(0.01)
            raise AssertionError(f"no reservation {n}: {sent}")

        stream = OutputStream()
        backend.open("r", list(range(3, 23)), SamplingParams(max_tokens=2), stream)
        first = await reservation(1)  # the decode worker is slow to answer it: the gateway gives up
        assert first.request_id == "r" and first.local_prefill_max_tokens > 0  # offered to prefill locally
        second = await reservation(2)
        assert second.request_id == "r.r2"  # asked again under a new id
        assert ("d-1", Abort(request_id="r", reason="reservation timed out", lease_unused=True)) in sent
        # now the late answer to the first ask, and the first token of that local prefill
        backend._dispatch(ReserveReply(request_id="r", worker_id="d-1", local=True))
        backend._dispatch(TokenOutput(request_id="r", worker_id="d-1", index=0, token_ids=[7]))
        assert len(stream) == 0  # the stale token found no record
        assert sent[-1] == ("d-1", Abort(request_id="r", reason="lease not used", lease_unused=True))
        # the answer to the second ask is the one that counts; its tokens reach the client
        backend._dispatch(ReserveReply(request_id="r.r2", worker_id="d-1", local=True))
        await asyncio.sleep(0.05)
        backend._dispatch(TokenOutput(request_id="r.r2", worker_id="d-1", index=0, token_ids=[8]))
        backend._dispatch(
            TokenOutput(request_id="r.r2", worker_id="d-1", index=1, token_ids=[9], finish_reason="length")
        )
        got = []
        while (out := await asyncio.wait_for(stream.get(), 2)) is not None:
            got.append(out)
        await backend.stop()
        return sent, got

    sent, got = asyncio.run(run())
    assert [o.token_ids for o in got] == [[8], [9]]  # none of the abandoned run's tokens
    assert all(o.request_id == "r" for o in got)  # the client's id
    assert [o.finish_reason for o in got] == [None, "length"]
