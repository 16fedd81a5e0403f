"""The gateway's request record and its one output queue (no processes): a cut or a reader leaving
stops the producer once; a migrated request continues its client's numbering and asks only for
what is left; a migrated group skips what its choices already streamed; the liveness check ends
an attempt whose worker went silent, and only then."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.output_stream import OutputStream, StreamCut
from pdserve.gateway.request_record import RequestRecord, WorkerLost
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import TokenOutput
from pdserve.protocol.sampling import SamplingParams
from tests.gateway.conftest import fake_worker


def _out(index: int, *tokens: int, seq: int = 0, rid: str = "r", finish: str | None = None) -> TokenOutput:
    return TokenOutput(request_id=rid, index=index, token_ids=list(tokens), seq_index=seq, finish_reason=finish)  # type: ignore[arg-type]


async def _read_all(stream: OutputStream) -> list[TokenOutput]:
    items = []
    while (out := await stream.get()) is not None:
        items.append(out)
    return items


def test_a_full_stream_is_cut_once_and_its_reader_told_after_what_was_queued():
    async def run() -> None:
        cuts, aborts = [], []
        stream = OutputStream(limit=2, on_cut=lambda: cuts.append(1))
        stream.on_abort = lambda: aborts.append(1)
        for i in range(5):  # the third push finds two waiting: cut; the rest are dropped
            stream.push(_out(i, 10 + i))
        assert cuts == [1] and aborts == [1] and stream.done
        assert [(await stream.get()).index, (await stream.get()).index] == [0, 1]  # type: ignore[union-attr]
        with pytest.raises(StreamCut, match="2 outputs waiting"):
            await stream.get()
        stream.close()
        assert aborts == [1]  # once

    asyncio.run(run())


def test_a_reader_leaving_aborts_the_producer_and_drops_later_outputs():
    async def run() -> None:
        aborts = []
        stream = OutputStream()
        stream.on_abort = lambda: aborts.append(1)
        waiter = asyncio.create_task(stream.get(timeout_s=5))
        await asyncio.sleep(0)
        stream.push(_out(0, 7))
        assert (await waiter).token_ids == [7]  # type: ignore[union-attr]
        stream.close()
        stream.push(_out(1, 8))
        assert aborts == [1] and len(stream) == 0
        with pytest.raises(TimeoutError):
            await OutputStream().get(timeout_s=0.01)

    asyncio.run(run())


def test_a_migrated_request_continues_its_numbering_and_asks_for_the_rest():
    async def run() -> tuple[list[TokenOutput], RequestRecord]:
        rec = RequestRecord("r", [1, 2, 3], SamplingParams(max_tokens=5, min_tokens=4), OutputStream())
        rec.begin_attempt()
        rec.state = "decoding"
        rec.accept(_out(0, 11))
        rec.accept(_out(2, 13, rid="r"))  # early: waits for index 1
        rec.accept(_out(1, 12))
        rec.end_attempt(WorkerLost(["d-1"]))  # its decode worker died
        rec.begin_attempt()
        prompt, sampling = rec.attempt_request()
        assert rec.worker_request_id == "r.m2" and prompt == [1, 2, 3, 11, 12, 13]
        assert (sampling.max_tokens, sampling.min_tokens) == (2, 1)
        rec.state = "decoding"
        rec.accept(_out(0, 14, rid="r.m2"))
        rec.accept(_out(1, 15, rid="r.m2", finish="length"))
        return await _read_all(rec.stream), rec

    outs, rec = asyncio.run(run())
    assert [(o.request_id, o.index, o.token_ids) for o in outs] == [
        ("r", 0, [11]),
        ("r", 1, [12]),
        ("r", 2, [13]),
        ("r", 3, [14]),
        ("r", 4, [15]),
    ]
    assert rec.state == "finished" and rec.generated == [11, 12, 13, 14, 15]


def test_a_migrated_group_skips_what_each_choice_already_streamed():
    async def run() -> list[tuple[int, int, list[int]]]:
        rec = RequestRecord("g", [1], SamplingParams(n=2, max_tokens=3, seed=1), OutputStream())
        rec.begin_attempt()
        rec.accept(_out(0, 5, 6, seq=0))
        rec.accept(_out(0, 7, seq=1))
        rec.end_attempt(WorkerLost(["d-1"]))
        rec.begin_attempt()  # runs again from the prompt: the same tokens come back first
        assert rec.attempt_request()[0] == [1]
        rec.accept(_out(0, 5, seq=0, rid="g.m2"))
        rec.accept(_out(1, 6, 8, seq=0, rid="g.m2", finish="length"))
        rec.accept(_out(0, 7, 9, 10, seq=1, rid="g.m2", finish="length"))
        return [(o.seq_index, o.index, o.token_ids) for o in await _read_all(rec.stream)]

    assert asyncio.run(run()) == [(0, 0, [5, 6]), (1, 0, [7]), (0, 2, [8]), (1, 1, [9, 10])]


def test_the_liveness_check_ends_an_attempt_whose_worker_went_silent(tmp_path):
    async def run() -> None:
        backend = ClusterBackend(FrameAuth(b"s" * 32), f"ipc://{tmp_path}/gw.sock", dead_after_s=0.05)
        p = WorkerEntry(fake_worker("p-1", "prefill", "ipc://p"))
        d = WorkerEntry(fake_worker("d-1", "decode", "ipc://d"))
        backend.table.workers.update({"p-1": p, "d-1": d})
        rec = RequestRecord("r", [1], SamplingParams(max_tokens=4), OutputStream())
        rec.begin_attempt()
        backend.requests.add(rec)
        rec.hold(p, d)
        rec.state = "prefilling"
        assert (p.inflight, d.inflight) == (1, 1)
        backend.check_liveness()
        assert not rec.over  # both heard just now
        rec.accept(_out(0, 9))  # the first token: the prefill worker is no longer watched
        assert rec.state == "decoding"
        await asyncio.sleep(0.1)
        d.last_seen = p.last_seen = 0.0
        backend.check_liveness()
        assert rec.outcome is not None
        with pytest.raises(WorkerLost) as lost:
            await rec.outcome
        assert lost.value.worker_ids == ["d-1"]
        rec.let_go()
        assert (p.inflight, d.inflight) == (0, 0) and rec.prefill is None and rec.decode is None

    asyncio.run(run())
