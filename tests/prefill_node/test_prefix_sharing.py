"""A prefill worker's prefix fetches (prefill_node/prefix_sharing.py), in this process: a request
naming a peer waits off the loop for that peer's blocks, and is queued when the fetch ends: with
the blocks as cached ones when it worked (two workers, one exporting to the other), with nothing
when the peer vanished (computed whole); one aborted meanwhile is never queued."""

from __future__ import annotations

import time

from pdserve.kvtransfer.prefix_exporter import PrefixExporter
from pdserve.prefill_node.worker import PrefillWorker
from pdserve.protocol.messages import KvDestination, KvLayout, Lease, PrefillRequest, PrefixSource
from pdserve.protocol.sampling import SamplingParams
from tests.prefill_node.test_kv_dtype_refused import _Sender
from tests.prefill_node.workers import prefill_worker

PROMPT = list(range(3, 3 + 61))  # 15 full blocks of 4 and one token: 15 usable


def request(worker: PrefillWorker, source: PrefixSource | None, request_id: str = "r") -> PrefillRequest:
    info = worker.engine.info
    layout = KvLayout(info.num_layers, 64, info.block_size, info.num_kv_heads, info.head_dim, info.kv_dtype)
    lease = Lease(epoch=1, block_ids=list(range(16)), deadline=time.time() + 30)
    dest = KvDestination(
        worker_id="d", kv_addr="ipc:///nowhere", shm_name=None, transport="zmq", lease=lease, layout=layout
    )
    return PrefillRequest(
        request_id=request_id,
        gateway_id="g",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=2),
        dest=dest,
        prefix_source=source,
    )


def make(tiny_llama) -> PrefillWorker:
    worker = prefill_worker(tiny_llama, block_size=4, num_blocks=64, budget=64, max_model_len=128)
    worker.rt.to_gateway = lambda gateway_id, msg: True  # type: ignore[method-assign]
    worker.senders.get = lambda dest: _Sender()  # type: ignore[method-assign]
    return worker


def turn_until(worker: PrefillWorker, done, timeout_s: float = 10.0, peer: PrefillWorker | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        if peer is not None:
            peer.sharing.serve()  # type: ignore[union-attr]
        worker.sharing.serve()  # type: ignore[union-attr]
        worker._after_fetches()
        time.sleep(0.01)


def test_blocks_a_peer_holds_are_fetched_before_the_prompt_is_queued(tiny_llama):
    a, b = make(tiny_llama), make(tiny_llama)
    try:
        assert a.sharing is not None and b.sharing is not None and a.rt.info.export_addr == a.sharing.addr
        a.engine.generate([PROMPT], SamplingParams(max_tokens=1))  # a computes the prompt: 15 blocks cached
        b._on_prefill(request(b, PrefixSource(worker_id="a", export_addr=a.sharing.addr, num_blocks=15, timeout_s=5)))
        assert "r" in b.requests and b.engine.find("r") is None  # waiting for its blocks
        turn_until(b, lambda: b.engine.find("r") is not None, peer=a)
        assert b.requests["r"].fetched_blocks == 15 and b.requests["r"].fetch_s > 0
        assert len(b.engine.cached_prefix(b.engine.prefix_hashes(PROMPT))) == 15
        st = b.stats()
        assert (st.prefix_fetches, st.prefix_fetch_blocks, st.prefix_fetch_failures) == (1, 15, 0)
        assert a.stats().prefix_export_blocks == 15
    finally:
        a.close()
        b.close()


def test_a_vanished_peer_leaves_the_prompt_computed_whole_and_an_abort_drops_the_wait(tiny_llama):
    worker = make(tiny_llama)
    gone = PrefixExporter(worker.ctx, worker.auth, "tcp://127.0.0.1:0", "m", request(worker, None).dest.layout, list)
    addr = gone.addr
    gone.close()
    try:
        worker._on_prefill(request(worker, PrefixSource(worker_id="a", export_addr=addr, num_blocks=15, timeout_s=5)))
        turn_until(worker, lambda: worker.engine.find("r") is not None)
        assert worker.requests["r"].fetched_blocks == 0 and worker.stats().prefix_fetch_failures == 1

        silent = PrefixExporter(
            worker.ctx, worker.auth, "tcp://127.0.0.1:0", "m", request(worker, None).dest.layout, list
        )
        src = PrefixSource(worker_id="a", export_addr=silent.addr, num_blocks=15, timeout_s=0.3)
        worker._on_prefill(request(worker, src, "s"))
        worker._abort("s")
        turn_until(worker, lambda: worker.stats().prefix_fetch_failures == 2)
        assert worker.engine.find("s") is None and "s" not in worker.requests
        silent.close()
    finally:
        worker.close()
