"""Prefix fetches between workers, the gateway's side, no processes: the cost rule (fetch a peer's
leading blocks when that is cheaper than computing them), which peers qualify, the hint a
PrefillRequest carries, and the kv-aware router's pick counting what a worker could fetch."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.gateway.cluster_members import ClusterMembers
from pdserve.gateway.membership import WorkerEntry, WorkerTable
from pdserve.gateway.placement_rates import PlacementRates
from pdserve.gateway.prefix_fetch_plan import (
    FETCH_OVERHEAD_S,
    MIN_FETCH_TIMEOUT_S,
    FetchRates,
    can_export_to,
    effective_held_tokens,
    plan_fetch,
)
from pdserve.gateway.request_flow import DisaggregatedFlow
from pdserve.gateway.router import Router
from pdserve.protocol.block_hashes import BlockHasher, short_id
from pdserve.protocol.messages import KvDigest, WorkerInfo
from pdserve.protocol.sampling import SamplingParams
from tests.gateway.conftest import fake_worker, single_try_flow
from tests.gateway.test_prefill_placement import RecordingPlane

KV_PER_TOKEN = 46080  # the real-shape model's fp32 KV: 30 layers, 3 KV heads of 64
RATES = FetchRates(block_size=16, kv_bytes_per_token=KV_PER_TOKEN, prefill_rate=2000.0, fetch_rate=1e9)


def test_a_long_prefix_is_fetched_and_a_short_one_or_a_slow_link_computed():
    plan = plan_fetch(0, {"a": 128, "b": 64}, 127, RATES)  # 2k tokens: 1 s to compute, ~0.1 s to fetch
    assert plan is not None and (plan.peer_id, plan.num_blocks, plan.tokens) == ("a", 127, 127 * 16)
    assert plan.fetch_s == pytest.approx(FETCH_OVERHEAD_S + 127 * 16 * KV_PER_TOKEN / 1e9)
    assert plan.compute_s == pytest.approx(127 * 16 / 2000) and plan.timeout_s == plan.compute_s
    assert plan_fetch(0, {"a": 1}, 127, RATES) is not None  # 8 ms of compute against 5.7 ms
    fast_compute = FetchRates(16, KV_PER_TOKEN, prefill_rate=20000.0, fetch_rate=1e9)
    assert plan_fetch(0, {"a": 1}, 127, fast_compute) is None  # the fetch's overhead alone is more
    slow_link = FetchRates(16, KV_PER_TOKEN, prefill_rate=2000.0, fetch_rate=50e6)
    assert plan_fetch(0, {"a": 128}, 127, slow_link) is None  # 1.9 s to fetch what computes in 1 s


def test_nothing_to_fetch_unless_a_peer_holds_more_than_the_worker_and_the_prompt_lets_it_be_used():
    assert plan_fetch(10, {"a": 10, "b": 4}, 127, RATES) is None
    assert plan_fetch(0, {}, 127, RATES) is None
    assert plan_fetch(6, {"a": 40}, 6, RATES) is None  # the usable blocks are held already
    plan = plan_fetch(2, {"a": 40}, 20, RATES)
    assert plan is not None and (plan.num_blocks, plan.tokens) == (20, 18 * 16)
    assert plan.timeout_s == MIN_FETCH_TIMEOUT_S  # 0.14 s of compute: the floor


def test_what_a_worker_counts_as_holding_for_the_router():
    plan = plan_fetch(0, {"a": 128}, 127, RATES)
    assert plan is not None
    assert effective_held_tokens(16, None) == 16
    assert 1800 < effective_held_tokens(0, plan) < 127 * 16  # the fetch's time costs a tenth of it


def info(worker_id: str, export: str | None = "ipc://x", **layout) -> WorkerInfo:
    w = fake_worker(worker_id, "prefill", f"ipc://{worker_id}", num_blocks=256)
    return msgspec.structs.replace(w, export_addr=export, kv_layout=msgspec.structs.replace(w.kv_layout, **layout))


def test_only_a_peer_of_the_same_model_and_block_layout_with_an_export_socket_qualifies():
    me = info("me")
    assert can_export_to(info("a", num_blocks=999), me)  # a pool of another size: its blocks fit
    assert not can_export_to(info("a", export=None), me)
    assert not can_export_to(info("a", dtype="bfloat16"), me)
    assert not can_export_to(info("a", block_size=32), me)
    assert not can_export_to(msgspec.structs.replace(info("a"), model_fingerprint="other"), me)
    assert not can_export_to(me, me)


PROMPT = list(range(3, 3 + 2000))


def cluster(b_exports: bool = True) -> tuple[DisaggregatedFlow, WorkerEntry, WorkerEntry]:
    """Prefill workers a (holding PROMPT's blocks) and b (holding none), a decode worker."""
    table = WorkerTable(dead_after_s=60)
    a = WorkerEntry(info("a", export="ipc://a-export"))
    b = WorkerEntry(info("b", export="ipc://b-export" if b_exports else None))
    table.workers.update({"a": a, "b": b})
    members = ClusterMembers(RecordingPlane(), "gw", table, lambda: None)  # type: ignore[arg-type]
    hashes = BlockHasher(a.info.model_fingerprint, 16).hashes(PROMPT)
    members.kv_index.apply("a", KvDigest(seq=1, full=True, stored=[short_id(h) for h in hashes]))
    flow = single_try_flow(members, Router("kv-aware"))
    flow.rates = PlacementRates()  # the defaults: 2000 tok/s, 1 GB/s
    return flow, a, b


def test_the_worker_lacking_the_prefix_is_told_which_peer_holds_it():
    flow, a, b = cluster()
    src = flow._prefix_source(b, PROMPT, SamplingParams())
    assert src is not None and (src.worker_id, src.export_addr, src.num_blocks) == ("a", "ipc://a-export", 124)
    assert src.timeout_s == max(MIN_FETCH_TIMEOUT_S, 124 * 16 / 2000)  # the time to compute them
    assert flow._prefix_source(a, PROMPT, SamplingParams()) is None  # it holds the most
    assert flow._prefix_source(b, PROMPT, SamplingParams(prompt_logprobs=1)) is None  # scored whole
    flow.table.workers["a"].gone = True  # a left: nobody to fetch from
    assert flow._prefix_source(b, PROMPT, SamplingParams()) is None


def test_an_idle_worker_that_can_fetch_takes_the_prompt_from_a_busy_holder():
    flow, a, b = cluster()
    assert flow._pick_prefill([a, b], PROMPT, {})[0] is a  # both idle: the holder
    a.inflight = 1
    flow.queued_prefill_tokens = lambda: {"a": 600}  # type: ignore[method-assign]
    assert flow._pick_prefill([a, b], PROMPT, {})[0] is b  # 0.3 s queued at a, ~0.1 s to fetch
    flow, a, b = cluster(b_exports=False)  # b shares no prefixes: it would compute all 2000
    flow.queued_prefill_tokens = lambda: {"a": 600}  # type: ignore[method-assign]
    assert flow._pick_prefill([a, b], PROMPT, {})[0] is a
