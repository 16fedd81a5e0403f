"""A worker's TokenOutputBatch reaches the gateway as one frame; each entry goes to its own
request's stream exactly as if it had come alone, and entries for unknown requests are dropped."""

from __future__ import annotations

import asyncio

from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import TokenOutput, TokenOutputBatch


def test_batch_entries_reach_their_own_streams(tmp_path):
    backend = ClusterBackend(FrameAuth(b"s" * 32), f"ipc://{tmp_path}/gw.sock")
    a, b = asyncio.Queue(), asyncio.Queue()
    backend._streams.update({"a": a, "b": b})
    outs = [
        TokenOutput(request_id="a", index=0, token_ids=[5]),
        TokenOutput(request_id="gone", index=0, token_ids=[6]),
        TokenOutput(request_id="b", index=4, token_ids=[7], finish_reason="length"),
        TokenOutput(request_id="a", index=1, token_ids=[8]),
    ]
    backend._dispatch(TokenOutputBatch(outputs=outs))
    assert [a.get_nowait(), a.get_nowait()] == [outs[0], outs[3]] and a.empty()
    assert b.get_nowait() == outs[2] and b.empty()
