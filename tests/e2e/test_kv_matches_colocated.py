"""KV bytes received by a decode pool == KV bytes a colocated run computes, for each transport.

A prefill engine streams a prompt's KV layer by layer (chunked: 3 chunks) through the real
KvStreamer, sender and receiver (also when chunking leaves the prompt's last token for a step of
its own); a colocated engine with the same scheduling computes the same
prompt. The decode pool's leased blocks must equal the colocated blocks bit for bit.
"""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from pdserve.engine.llm_engine import PREFILLED
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import make_kv_sender
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.prefill_node.kv_streamer import KvStreamer
from pdserve.prefill_node.request_record import PrefillRecord
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDestination, KvLayout, PrefillRequest
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.engine.test_engine_vs_hf import make_engine

SP = SamplingParams(max_tokens=2, temperature=0.0)


def prefill_keeping_kv(engine, prompt, hook_factory=None):
    """Prefill-only run; returns the prompt's block ids (their KV stays in the pool after free)."""
    engine.add_request("r", prompt, SP, prefill_only=True)
    table = None
    while engine.has_work():
        sched = engine.schedule()
        table = list(sched.chunks[0].seq.block_table)
        outs = engine.execute(sched, hook_factory(sched) if hook_factory else None)
    assert outs[0].finish_reason == PREFILLED
    return table


@pytest.mark.parametrize(
    "length,kv_cache_dtype",
    [(41, "auto"), (33, "auto"), (41, "int8"), (41, "fp8")],  # chunks of 16, 16 and 9; 16, 16 and the last token alone
)
@pytest.mark.parametrize("transport", ["zmq-tcp", "zmq-ipc", "shm"])
def test_received_kv_equals_colocated_kv(tiny_llama, tmp_path, transport, length, kv_cache_dtype):
    """int8, fp8 (--kv-cache-dtype): the blocks' values and scales, as stored."""
    budget = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    colocated, prefill = make_engine(tiny_llama, **budget), make_engine(tiny_llama, **budget)
    prompt = random_prompts(colocated.model_config.vocab_size, [length], seed=9)[0]
    ref_blocks = prefill_keeping_kv(colocated, prompt)
    reference = colocated.kv_cache[:, :, ref_blocks].clone()  # [L, 2, n, bs, H, D]

    spec = prefill.kv_spec
    n_dst = 32
    pool = SharedTensor.create(spec.shape(n_dst), spec.dtype)
    ctx = zmq.Context()
    try:
        pool.tensor.zero_()
        leases = LeaseTable(spec.num_layers)
        bind = {"zmq-tcp": "tcp://127.0.0.1:0"}.get(transport, f"ipc://{tmp_path}/kv.sock")
        auth = FrameAuth(b"s" * 32)
        receiver = KvReceiver(ctx, auth, bind, pool.tensor, leases)
        dst_blocks = list(range(n_dst - len(ref_blocks), n_dst))[::-1]  # scattered, reversed
        lease = leases.grant("r", dst_blocks, ttl_s=30)
        layout = KvLayout(
            spec.num_layers,
            n_dst,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            str(spec.dtype).removeprefix("torch."),
        )
        sender = make_kv_sender(
            "shm" if transport == "shm" else "zmq",
            ctx=ctx,
            auth=auth,
            kv_addr=receiver.addr,
            shm_name=pool.name,
            layout=layout,
        )
        dest = KvDestination(
            worker_id="d",
            kv_addr=receiver.addr,
            shm_name=pool.name,
            transport="shm" if transport == "shm" else "zmq",
            lease=lease,
            layout=layout,
        )
        streamer = KvStreamer(prefill.kv_cache, prefill.block_size)
        req = PrefillRequest(request_id="r", gateway_id="g", prompt_token_ids=prompt, sampling=SP, dest=dest)
        record = PrefillRecord(req, sender, received=time.monotonic())

        prefill_keeping_kv(prefill, prompt, lambda sched: streamer.prepare(sched, {"r": record}))
        assert record.transfer.error is None and record.transfer.bytes > 0
        sender.send_done(record.kv_done(prompt[0], None, spec.num_layers, {}))
        done, deadline = [], time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            done = receiver.poll(50)
        assert [d.request_id for d in done] == ["r"]
        received = pool.tensor[:, :, dst_blocks]
        assert torch.equal(received, reference)
        assert receiver.bytes_received == record.transfer.bytes >= reference.numel() * reference.element_size()
        sender.close()
        receiver.close()
    finally:
        ctx.destroy(linger=0)
        pool.close()
