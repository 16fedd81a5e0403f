"""Quantized KV blocks (--kv-cache-dtype int8|fp8) ship as stored: values and their scales, over
ZeroMQ and written in place into a shared-memory pool advertised as `int8` (fp8: `uint8`) with the
model's head_dim; a frame of another dtype is dropped before it touches a block."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kernels import kv_quant
from pdserve.kernels.kv_quant import FP8, INT8, RowFormat
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import make_kv_sender
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDone, KvLayout

L, N, BS, H, D = 3, 12, 4, 2, 8
AUTH = FrameAuth(b"k" * 32, encryption="off")


def drain(receiver: KvReceiver, want: int = 1, timeout_s: float = 5.0) -> list[KvDone]:
    done: list[KvDone] = []
    deadline = time.monotonic() + timeout_s
    while len(done) < want and time.monotonic() < deadline:
        done += receiver.poll(50)
    return done


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=lambda f: f.kv_cache_dtype)
@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_quantized_blocks_land_with_their_scales(ctx, tmp_path, transport, fmt: RowFormat):
    shared = SharedTensor.create((L, 2, N, BS, H, D + kv_quant.SCALE_BYTES), fmt.pool_dtype)  # D's pool
    try:
        dst = shared.tensor
        leases = LeaseTable(L)
        with KvReceiver(ctx, AUTH, f"ipc://{tmp_path}/kv.sock", dst, leases) as receiver:
            src = kv_quant.quantize(torch.randn(L, 2, 20, BS, H, D) * 3, fmt)  # P's pool [L, 2, 20, BS, H, D + 4]
            src_blocks, dst_blocks = [7, 3, 11, 12], [5, 0, 9, 10]
            lease = leases.grant("r1", dst_blocks, ttl_s=30)
            # the model's head_dim: the row's width follows from the dtype ("int8", "uint8")
            layout = KvLayout(L, N, BS, H, D, str(fmt.pool_dtype).removeprefix("torch."))
            sender = make_kv_sender(
                transport, ctx=ctx, auth=AUTH, kv_addr=receiver.addr, shm_name=shared.name, layout=layout
            )
            try:
                sent = sum(
                    sender.send_layer("r1", lease, layer, src[layer], src_blocks, dst_blocks) for layer in range(L)
                )
                assert sent == L * len(src_blocks) * 2 * BS * H * (D + 4)  # a quarter of fp32's 4 * D, plus scales
                assert sender.send_done(KvDone(request_id="r1", lease_epoch=lease.epoch, num_layers=L, kv_bytes=sent))
                assert [d.request_id for d in drain(receiver)] == ["r1"]
            finally:
                sender.close()
            assert torch.equal(dst[:, :, dst_blocks], src[:, :, src_blocks])
            assert torch.equal(kv_quant.dequantize(dst[:, :, dst_blocks]), kv_quant.dequantize(src[:, :, src_blocks]))
    finally:
        shared.close()


@pytest.mark.parametrize(
    "theirs,ours",
    [("fp32", INT8), ("int8", FP8), ("fp8", INT8)],  # P's KV dtype, D's pool
)
def test_a_frame_of_another_kv_dtype_is_dropped(ctx, tmp_path, theirs, ours: RowFormat):
    """A prefill worker's frame at a pool of another KV dtype (fp32, or the other quantized format,
    whose rows are as wide): refused as a layout mismatch, no block written."""
    dst = torch.zeros(L, 2, N, BS, H, D + kv_quant.SCALE_BYTES, dtype=ours.pool_dtype)
    frame = torch.randn(2, 4, BS, H, D)
    if theirs != "fp32":
        frame = kv_quant.quantize(frame, INT8 if theirs == "int8" else FP8)  # [2, 4, BS, H, D + 4]
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, f"ipc://{tmp_path}/kv.sock", dst, leases) as receiver:
        lease = leases.grant("r1", [1, 2], ttl_s=30)
        layout = KvLayout(L, N, BS, H, D, str(frame.dtype).removeprefix("torch."))
        sender = make_kv_sender("zmq", ctx=ctx, auth=AUTH, kv_addr=receiver.addr, shm_name=None, layout=layout)
        try:
            sender.send_layer("r1", lease, 0, frame, [0, 1], [1, 2])
            deadline = time.monotonic() + 5
            while not receiver.dropped and time.monotonic() < deadline:
                receiver.poll(50)
        finally:
            sender.close()
        assert receiver.dropped["layout_mismatch"] == 1
        assert not dst.any()
