"""A worker's TokenOutputBatch reaches the gateway as one frame; each entry goes to its own
request's stream exactly as if it had come alone, and entries for unknown requests are dropped."""

from __future__ import annotations

import asyncio

from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.gateway.output_stream import OutputStream
from pdserve.gateway.request_record import RequestRecord
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import TokenOutput, TokenOutputBatch
from pdserve.protocol.sampling import SamplingParams


def test_batch_entries_reach_their_own_streams(tmp_path):
    async def run() -> tuple[list, list, bool, bool]:
        backend = ClusterBackend(FrameAuth(b"s" * 32), f"ipc://{tmp_path}/gw.sock")
        records = {}
        for rid, start in (("a", 0), ("b", 4)):
            rec = RequestRecord(rid, [1, 2], SamplingParams(max_tokens=8), OutputStream())
            rec.begin_attempt()
            rec.state = "decoding"
            rec.order.next_index[0] = start
            backend.requests.add(rec)
            records[rid] = rec
        outs = [
            TokenOutput(request_id="a", index=0, token_ids=[5]),
            TokenOutput(request_id="gone", index=0, token_ids=[6]),
            TokenOutput(request_id="b", index=4, token_ids=[7], finish_reason="length"),
            TokenOutput(request_id="a", index=1, token_ids=[8]),
        ]
        backend._dispatch(TokenOutputBatch(outputs=outs))
        a, b = records["a"].stream, records["b"].stream
        got_a = [await a.get(), await a.get()]
        got_b = [await b.get(), await b.get()]  # its output, then the stream's end
        assert got_a == [outs[0], outs[3]] and len(a) == 0
        return got_a, got_b, records["b"].over, records["a"].over

    got_a, got_b, b_over, a_over = asyncio.run(run())
    assert got_b[0].token_ids == [7] and got_b[1] is None  # b finished: its stream ended
    assert b_over and not a_over


def test_early_outputs_wait_for_the_gap_before_them(tmp_path):
    """D's tokens may come before P's first (different sockets): they go out in index order."""

    async def run() -> list[int]:
        rec = RequestRecord("r", [1], SamplingParams(max_tokens=3), OutputStream())
        rec.begin_attempt()
        for index in (2, 1, 0):
            reason = "length" if index == 2 else None
            rec.accept(TokenOutput(request_id="r", index=index, token_ids=[10 + index], finish_reason=reason))
        tokens = []
        while (out := await rec.stream.get()) is not None:
            tokens += out.token_ids
        return tokens

    assert asyncio.run(run()) == [10, 11, 12]
