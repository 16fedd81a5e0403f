"""A draft model's layers in the same transfer (kvtransfer/lease.py `draft_layers`): numbered
after the target's, they land in the decode worker's draft pool at the same block ids, over
ZMQ and next to shared-memory writes (as payload frames); a transfer completes with the
target's layers alone or with all of both, never with part of the draft's; a draft frame for a
receiver without a draft pool is dropped."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import make_kv_sender
from pdserve.protocol.messages import KvDone, KvLayout
from tests.kvtransfer.test_transports import AUTH, BS, D, H, L, N, drain, pool, untouched  # noqa: F401

LD, HD, DD = 2, 1, 4  # the draft: fewer layers, heads and head size than the target


@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_draft_layers_land_in_the_draft_pool(ctx, tmp_path, pool, transport):  # noqa: F811
    dst, dst_draft = pool.tensor, torch.full((LD, 2, N, BS, HD, DD), -1.0)
    leases = LeaseTable(L, draft_layers=LD)
    with KvReceiver(ctx, AUTH, f"ipc://{tmp_path}/kv.sock", dst, leases, draft_kv_cache=dst_draft) as receiver:
        src, src_draft = torch.randn(L, 2, 20, BS, H, D), torch.randn(LD, 2, 20, BS, HD, DD)
        src_blocks, dst_blocks = [7, 3, 11, 12], [5, 0, 9, 10]
        layout = KvLayout(L, N, BS, H, D, "float32", draft_fingerprint="draft")
        sender = make_kv_sender(transport, ctx=ctx, auth=AUTH, kv_addr=receiver.addr, shm_name=pool.name, layout=layout)
        try:
            full = leases.grant("both", dst_blocks, ttl_s=30)
            sent = sum(sender.send_layer("both", full, j, src[j], src_blocks, dst_blocks) for j in range(L))
            sent += sum(sender.send_layer("both", full, L + j, src_draft[j], src_blocks, dst_blocks) for j in range(LD))
            sender.send_done(KvDone(request_id="both", lease_epoch=full.epoch, num_layers=L + LD, kv_bytes=sent))
            assert [d.request_id for d in drain(receiver)] == ["both"]
            for s, d in zip(src_blocks, dst_blocks):
                assert torch.equal(dst[:, :, d], src[:, :, s])
                assert torch.equal(dst_draft[:, :, d], src_draft[:, :, s])
            assert untouched(dst_draft, dst_blocks)
            # the target's layers alone (a prefill worker without the draft): complete too
            alone = leases.grant("alone", [1, 2], ttl_s=30)
            for j in range(L):
                sender.send_layer("alone", alone, j, src[j], [0, 1], [1, 2])
            sender.send_done(KvDone(request_id="alone", lease_epoch=alone.epoch, num_layers=L))
            assert [d.request_id for d in drain(receiver)] == ["alone"]
            assert untouched(dst_draft, dst_blocks)  # (blocks 1, 2: no draft KV written)
            # part of the draft's layers: refused as incomplete
            part = leases.grant("part", [3], ttl_s=30)
            for j in range(L + 1):
                sender.send_layer("part", part, j, src[j] if j < L else src_draft[0], [0], [3])
            sender.send_done(KvDone(request_id="part", lease_epoch=part.epoch, num_layers=L + LD))
            assert drain(receiver, timeout_s=1.0) == []
            assert [(d.request_id, why) for d, why in receiver.failed_done] == [("part", "incomplete")]
        finally:
            sender.close()
        assert dict(receiver.dropped) == {"incomplete": 1}  # (that KvDone) and nothing else


def test_a_draft_layer_without_a_draft_pool_is_dropped(ctx, tmp_path):  # noqa: F811
    dst = torch.full((L, 2, N, BS, H, D), -1.0)
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, f"ipc://{tmp_path}/kv.sock", dst, leases) as receiver:
        sender = make_kv_sender("zmq", ctx=ctx, auth=AUTH, kv_addr=receiver.addr)
        try:
            lease = leases.grant("r", [4], ttl_s=30)
            sender.send_layer("r", lease, L, torch.randn(2, 3, BS, HD, DD), [0], [4])
            sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L + LD))
            assert drain(receiver, timeout_s=1.0) == []
        finally:
            sender.close()
        assert receiver.dropped["bad_layer"] == 1
        assert (dst == -1).all()


def test_layouts_of_older_and_newer_workers_parse():
    """`KvLayout.draft_fingerprint` has a default: an older worker's layout (without it) parses as
    "no draft", and an older worker's struct (without the field) reads a newer layout."""

    class OlderLayout(msgspec.Struct, frozen=True):
        num_layers: int
        num_blocks: int
        block_size: int
        num_kv_heads: int
        head_dim: int
        dtype: str
        kv_head_start: int = 0

    old = msgspec.msgpack.encode(OlderLayout(L, N, BS, H, D, "float32"))
    assert msgspec.msgpack.decode(old, type=KvLayout) == KvLayout(L, N, BS, H, D, "float32", draft_fingerprint="")
    new = msgspec.msgpack.encode(KvLayout(L, N, BS, H, D, "float32", draft_fingerprint="llama/L4"))
    assert msgspec.msgpack.decode(new, type=OlderLayout) == OlderLayout(L, N, BS, H, D, "float32")
