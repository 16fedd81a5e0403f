"""KV-aware routing, without processes: the gateway's index of what each worker holds, built
from heartbeat digests, and the scores that pick decode and prefill workers."""

from __future__ import annotations

import os

from pdserve.gateway.kv_index import KvIndex
from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.router import decode_order, pick_prefill
from pdserve.protocol.messages import KvDigest, KvLayout, WorkerInfo, WorkerStats


def worker(wid: str, role: str = "decode", free: int = 100, running: int = 0, inflight: int = 0) -> WorkerEntry:
    info = WorkerInfo(
        worker_id=wid,
        role=role,  # type: ignore[arg-type]
        control_addr="ipc:///x",
        host="h",
        pid=os.getpid(),
        model_fingerprint="m",
        kv_layout=KvLayout(1, 128, 16, 1, 1, "float32"),
        max_num_seqs=8,
    )
    return WorkerEntry(info, WorkerStats(kv_blocks_free=free, num_running=running), inflight=inflight)


def test_index_follows_deltas_and_drops_a_worker_on_a_gap_until_its_next_full_set():
    idx = KvIndex()
    idx.apply("d", KvDigest(seq=1, full=True, stored=[1, 2, 3]))
    assert idx.leading_blocks("d", [1, 2, 3, 4]) == 3
    idx.apply("d", KvDigest(seq=2, stored=[4], removed=[2]))
    assert idx.leading_blocks("d", [1, 2, 3, 4]) == 1 and idx.leading_blocks("d", [4]) == 1
    idx.apply("d", KvDigest(seq=4, stored=[2]))  # seq 3 was lost: nothing known now
    assert idx.leading_blocks("d", [1]) == 0
    idx.apply("d", KvDigest(seq=5, stored=[1]))  # deltas alone do not restore it
    assert idx.leading_blocks("d", [1]) == 0
    idx.apply("d", KvDigest(seq=6, full=True, stored=[1, 2]))
    assert idx.leading_blocks("d", [1, 2, 9]) == 2
    idx.forget("d")
    assert idx.num_held("d") == 0 and idx.leading_blocks("unknown", [1]) == 0


def test_decode_goes_where_the_prompt_is_held_unless_that_worker_lacks_room():
    a, b, c = worker("a", free=100), worker("b", free=20), worker("c", free=60)
    assert [w.worker_id for w in decode_order([a, b, c], {}, 160)] == ["a", "c", "b"]  # most free KV
    assert [w.worker_id for w in decode_order([a, b, c], {"b": 4}, 160)] == ["b", "a", "c"]
    full = worker("b", free=3)  # holds 4 of 10 blocks, but the other 6 do not fit
    assert [w.worker_id for w in decode_order([a, full, c], {"b": 4}, 160)][0] == "a"
    busy = worker("b", free=100, running=8)  # every seat taken
    assert decode_order([a, busy, c], {"b": 4}, 160)[0].worker_id == "a"


def test_a_burst_spreads_over_equal_decode_workers_before_any_heartbeat():
    a, b = worker("a"), worker("b")
    assert decode_order([a, b], {}, 160)[0].worker_id == "a"
    a.reserving += 1  # the first request of the burst is asking a: the next one asks b
    assert decode_order([a, b], {}, 160)[0].worker_id == "b"
    a.reserving, a.inflight = 0, 3
    b.inflight = 1
    assert decode_order([a, b], {}, 160)[0].worker_id == "b"
    assert decode_order([a, b], {"a": 2}, 160)[0].worker_id == "a"  # held blocks still come first


def test_prefill_goes_where_the_least_work_waits_before_the_first_token():
    p, q = worker("p", "prefill"), worker("q", "prefill")
    assert pick_prefill([p, q], {"q": 512}, {}, 600).worker_id == "q"  # q holds 512 of 600 tokens
    # q holds the prompt but 2000 tokens wait there; p computes all 600 with nothing queued
    assert pick_prefill([p, q], {"q": 512}, {"q": 2000}, 600).worker_id == "p"
    assert pick_prefill([p, q], {}, {"p": 100}, 600).worker_id == "q"
