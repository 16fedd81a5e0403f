"""A prefill worker handed a decode worker whose KV pool stores another dtype (--kv-cache-dtype
differs) refuses the request before computing it: an error to the gateway naming both dtypes, the
lease released to D, nothing added to its engine. (The gateway pairs workers by model fingerprint,
which names the KV dtype, so this is the last line, not the first.)"""

from __future__ import annotations

import time

import pytest

from pdserve.protocol.messages import KvDestination, KvLayout, Lease, PrefillRequest, TokenOutput
from pdserve.protocol.sampling import SamplingParams
from tests.prefill_node.workers import prefill_worker


class _Sender:
    def __init__(self) -> None:
        self.released: list[tuple[str, int]] = []

    def send_release(self, request_id: str, epoch: int) -> None:
        self.released.append((request_id, epoch))


@pytest.mark.parametrize("theirs,named", [("int8", "int8"), ("uint8", "--kv-cache-dtype fp8")])
def test_a_decode_pool_of_another_kv_dtype_is_refused(tiny_llama, theirs, named):
    worker = prefill_worker(tiny_llama, block_size=4, num_blocks=32, budget=64, max_model_len=128)
    try:
        info = worker.engine.info
        assert info.kv_dtype == "float32"
        sent: list[TokenOutput] = []
        sender = _Sender()
        worker.rt.to_gateway = lambda gateway_id, msg: sent.append(msg)  # type: ignore[method-assign]
        worker.senders.get = lambda dest: sender  # type: ignore[method-assign]
        layout = KvLayout(info.num_layers, 32, info.block_size, info.num_kv_heads, info.head_dim, theirs)
        lease = Lease(epoch=3, block_ids=[0, 1, 2, 3, 4], deadline=time.time() + 30)
        dest = KvDestination(
            worker_id="d", kv_addr="ipc:///nowhere", shm_name=None, transport="zmq", lease=lease, layout=layout
        )
        req = PrefillRequest(
            request_id="r", gateway_id="g", prompt_token_ids=list(range(3, 20)), sampling=SamplingParams(), dest=dest
        )
        worker._on_prefill(req)
        assert [m.finish_reason for m in sent] == ["error"]
        assert "KV cache dtype mismatch" in (sent[0].error or "") and named in (sent[0].error or "")
        assert sender.released == [("r", 3)]
        assert "r" not in worker.engine.seqs and "r" not in worker.requests
    finally:
        worker.close()
