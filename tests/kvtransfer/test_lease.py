"""Lease rules on the decode side: epochs, deadlines, blocks, layers, replays, quarantine."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.wire import KvFrameHeader
from pdserve.protocol.messages import KvDone

L = 3


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def frame(rid, epoch, layer, blocks, seq, nbytes=0):
    return KvFrameHeader(
        request_id=rid,
        lease_epoch=epoch,
        layer=layer,
        block_ids=blocks,
        kv_head_start=0,
        kv_head_end=1,
        dtype="float32",
        shape=[2, len(blocks), 1, 1, 1],
        nbytes=nbytes,
        seq=seq,
    )


def write_all(table, rid, lease, seq0=0):
    for layer in range(L):
        f = frame(rid, lease.epoch, layer, lease.block_ids, seq0 + layer)
        assert table.check_frame(f) is None
        table.mark_frame(f)


def test_epochs_grow_and_are_seeded_randomly():
    a, b = LeaseTable(L), LeaseTable(L)
    e1, e2 = a.grant("r1", [1], 10).epoch, a.grant("r2", [2], 10).epoch
    assert e2 > e1
    assert abs(b.grant("r1", [1], 10).epoch - e1) > 1000  # a new process never reuses the old epochs
    with pytest.raises(ValueError):
        a.grant("r1", [3], 10)  # one active lease per request
    for bad in ([], [1, 1], [-1]):
        with pytest.raises(ValueError):
            a.grant("x", bad, 10)


def test_check_frame_reasons():
    clock = Clock()
    t = LeaseTable(L, clock=clock)
    lease = t.grant("r", [4, 5, 6], ttl_s=10)
    ep = lease.epoch
    assert t.check_frame(frame("r", ep, 0, [4, 5, 6], 0)) is None
    assert t.check_frame(frame("nobody", ep, 0, [4], 0)) == "unknown_lease"
    assert t.check_frame(frame("r", ep - 1, 0, [4], 0)) == "stale_epoch"
    assert t.check_frame(frame("r", ep + 1, 0, [4], 0)) == "stale_epoch"
    assert t.check_frame(frame("r", ep, L, [4], 0)) == "bad_layer"
    assert t.check_frame(frame("r", ep, -1, [4], 0)) == "bad_layer"
    assert t.check_frame(frame("r", ep, 0, [4, 7], 0)) == "blocks_not_leased"
    assert t.check_frame(frame("r", ep, 0, [4, 4], 0)) == "blocks_not_leased"
    assert t.check_frame(frame("r", ep, 0, [], 0)) == "blocks_not_leased"
    f = frame("r", ep, 0, [4, 5], 0)
    t.mark_frame(f)
    assert t.check_frame(f) == "duplicate"  # replayed frame (same seq)
    assert t.check_frame(frame("r", ep, 1, [4], 0)) == "duplicate"  # out of order
    assert t.check_frame(frame("r", ep, 0, [5, 6], 1)) is None  # the same layer again, new blocks: fine
    clock.t += 10.001
    assert t.check_frame(frame("r", ep, 0, [4], 5)) == "expired"
    assert t.expired() == ["r"] and t.get("r") is not None  # a query changes nothing


def test_complete_needs_every_layer_of_every_block_chunked_or_not():
    t = LeaseTable(L)
    lease = t.grant("r", [0, 1, 2, 3], ttl_s=10)
    ep = lease.epoch
    seq = 0
    for layer in range(L):  # chunk 1: blocks 0-1 (1 partly filled)
        t.mark_frame(frame("r", ep, layer, [0, 1], seq))
        seq += 1
    assert t.complete("r", ep, L) == "incomplete"
    for layer in range(L - 1):  # chunk 2: blocks 1-3 re-sent, last layer missing
        t.mark_frame(frame("r", ep, layer, [1, 2, 3], seq))
        seq += 1
    assert t.complete("r", ep, L) == "incomplete"
    t.mark_frame(frame("r", ep, L - 1, [1, 2, 3], seq))
    assert t.complete("r", ep, L - 1) == "layer_count"
    assert t.complete("r", ep + 1, L) == "stale_epoch"
    assert t.complete("r", ep, L) is None
    assert t.check_done(KvDone(request_id="r", lease_epoch=ep, num_layers=L)) is None
    assert t.check_done(KvDone(request_id="r", lease_epoch=ep, num_layers=L, kv_bytes=123)) == "bytes_mismatch"


def test_replay_of_a_completed_request_is_refused():
    t = LeaseTable(L)
    lease = t.grant("r", [7], ttl_s=10)
    write_all(t, "r", lease)
    done = KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L)
    assert t.check_done(done) is None
    assert t.release("r") == lease  # blocks now belong to the running sequence
    assert t.check_done(done) == "unknown_lease"
    assert t.check_frame(frame("r", lease.epoch, 0, [7], 99)) == "unknown_lease"
    again = t.grant("r", [8], ttl_s=10)  # same request id later (e.g. a retry): new epoch
    assert t.check_frame(frame("r", lease.epoch, 0, [8], 99)) == "stale_epoch"
    assert t.check_done(done) == "stale_epoch"
    assert again.epoch > lease.epoch


def test_quarantine_until_deadline_plus_grace():
    clock = Clock()
    t = LeaseTable(L, grace_s=0.5, clock=clock)
    aborted = t.grant("a", [1, 2], ttl_s=5)
    t.grant("e", [3], ttl_s=2)
    t.grant("live", [9], ttl_s=60)
    assert t.revoke("a") and not t.revoke("a")
    assert t.check_frame(frame("a", aborted.epoch, 0, [1], 0)) == "unknown_lease"
    assert t.num_quarantined_blocks == 2
    assert t.reclaimable() == []  # a P that missed the abort may still be writing
    clock.t += 2.01
    assert t.expire() == ["e"] and t.num_active == 1
    assert t.reclaimable() == []  # "e" too: deadline passed but still inside the grace
    clock.t += 0.5
    assert t.reclaimable() == [3]
    clock.t += 2.5
    assert t.reclaimable() == []  # 5.01 s: aborted lease's deadline passed, grace not yet
    clock.t += 0.5
    assert sorted(t.reclaimable()) == [1, 2]
    assert t.reclaimable() == [] and t.num_quarantined_blocks == 0  # each block handed back once
    assert t.get("live") is not None


def test_renewal_moves_an_active_lease_forward_only():
    clock = Clock()
    table = LeaseTable(L, clock=clock)
    lease = table.grant("r", [4, 5], 10)
    assert lease.ttl_s == 10
    clock.t += 8  # queued behind other prompts; P renews with 2 s left
    renewed = table.renew("r", lease.epoch)
    assert renewed is not None and renewed.deadline == clock.t + 10 and renewed.epoch == lease.epoch
    clock.t += 9  # past the first deadline: frames are still welcome, and the KV completes
    write_all(table, "r", renewed)
    assert table.complete("r", lease.epoch, L) is None
    clock.t -= 15  # a renewal never moves the deadline back
    assert table.renew("r", lease.epoch).deadline == renewed.deadline
    assert table.renew("r", lease.epoch + 1) is None  # another epoch: nothing


def test_ended_leases_are_not_renewed_and_stay_fenced():
    clock = Clock()
    table = LeaseTable(L, clock=clock)
    revoked = table.grant("a", [1], 10)
    table.revoke("a")
    assert table.renew("a", revoked.epoch) is None
    expired = table.grant("b", [2], 10)
    clock.t += 11
    assert table.renew("b", expired.epoch) is None  # too late: it ran out first
    assert table.expire() == ["b"]
    assert table.check_frame(frame("b", expired.epoch, 0, [2], 0)) == "unknown_lease"
    # both come back only after their (unrenewed) deadlines plus the grace
    assert table.reclaimable() == [] and sorted(table.reclaimable(clock.t + 0.5)) == [1, 2]


def test_abort_frees_at_once_only_when_the_writer_is_gone():
    clock = Clock()
    t = LeaseTable(L, clock=clock)
    t.grant("held", [1, 2], ttl_s=5)  # a prefill worker may still write it
    t.grant("unsent", [3], ttl_s=5)  # never handed to a prefill worker
    assert t.abort("held", writer_gone=False) == [] and "held" not in t
    assert t.num_quarantined_blocks == 2
    assert t.abort("unsent", writer_gone=True) == [3] and t.num_active == 0
    # later the gateway learns the writer of "held" is gone too: its quarantine ends early
    assert t.abort("held", writer_gone=True) == [1, 2] and t.num_quarantined_blocks == 0
    assert t.abort("held", writer_gone=True) == [] and t.abort("never", writer_gone=False) == []
    clock.t += 60
    assert t.reclaimable() == []  # each block comes back once


def test_every_granted_block_comes_back_exactly_once():
    """The ledger over a mixed history: admitted, aborted (both ways), expired, released early."""
    clock = Clock()
    t = LeaseTable(L, clock=clock)
    leases = {rid: t.grant(rid, [i * 2, i * 2 + 1], ttl_s=5) for i, rid in enumerate("abcdef")}
    back = list(t.release("a").block_ids)  # admitted: the sequence owns them now
    back += t.abort("b", writer_gone=True)
    back += t.abort("c", writer_gone=False)  # quarantined
    back += t.release_early("d", leases["d"].epoch)
    write_all(t, "e", leases["e"])  # written, but its KvDone never comes
    assert t.expire() == []
    clock.t += 5.5
    assert t.expire() == ["e", "f"]
    assert t.reclaimable() == []  # c, e, f: past the deadline, not the grace
    clock.t += 1.0
    back += t.reclaimable()
    assert sorted(back) == list(range(12)) and t.num_active == 0 and t.num_quarantined_blocks == 0


def test_prefix_blocks_are_never_writable_and_come_back_at_once():
    """Blocks the decode worker already holds for the prompt (its prefix cache) ride the lease:
    no frame may write them, admission gets them first, any other end frees them at once."""
    clock = Clock()
    t = LeaseTable(L, clock=clock)
    lease = t.grant("a", [7, 8], ttl_s=5, prefix_block_ids=[1, 2])
    assert lease.prefix_block_ids == [1, 2]
    assert t.check_frame(frame("a", lease.epoch, 0, [1], 0)) == "blocks_not_leased"
    write_all(t, "a", lease)  # the leased blocks alone complete it
    assert t.complete("a", lease.epoch, L) is None
    assert t.release("a").prefix_block_ids == [1, 2]
    t.grant("b", [9], ttl_s=5, prefix_block_ids=[3])
    assert t.abort("b", writer_gone=False) == [] and t.reclaimable() == [3]  # the prefix: at once
    clock.t += 7
    assert t.reclaimable() == [9]  # the written block: after deadline and grace
    c = t.grant("c", [10], ttl_s=5, prefix_block_ids=[4])
    assert sorted(t.release_early("c", c.epoch)) == [4, 10]
    t.grant("d", [11], ttl_s=5, prefix_block_ids=[5])
    assert sorted(t.abort("d", writer_gone=True)) == [5, 11]
    with pytest.raises(ValueError):
        t.grant("e", [12], ttl_s=5, prefix_block_ids=[12])  # a block is leased or held, not both
