"""Prefill placement (conditional disaggregation) on a simulated cluster, no processes: the cost
model's thresholds, the router's offer per placement, the gateway's measured rates, and the
request flow's reservation (offer sent, a decode worker's refusal falls back to the pool)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from pdserve.gateway.cluster_members import ClusterMembers
from pdserve.gateway.membership import WorkerEntry, WorkerTable
from pdserve.gateway.output_stream import OutputStream
from pdserve.gateway.placement_rates import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    LOCAL_RATE_TTL_S,
    PlacementRates,
    kv_bytes_per_token,
)
from pdserve.gateway.prefill_placement import PlacementInputs, placement_costs, prefill_locally
from pdserve.gateway.request_flow import DisaggregatedFlow
from pdserve.gateway.request_record import RequestRecord
from pdserve.gateway.router import LOCAL_ALWAYS_MAX_TOKENS, Router
from pdserve.protocol.messages import Lease, ReserveReply, ReserveRequest, WorkerStats
from pdserve.protocol.sampling import SamplingParams
from tests.gateway.conftest import fake_worker, single_try_flow

KV_PER_TOKEN = 2 * 24 * 8 * 64 * 4  # 24 layers, 8 KV heads of 64, fp32: 196608 bytes a token


def inputs(tokens: int, **kw) -> PlacementInputs:
    """An uncached prompt of `tokens` on an idle cluster whose two pools prefill 4000 tok/s, over
    a 2 GB/s link."""
    base = PlacementInputs(
        local_tokens=tokens,
        remote_tokens=tokens,
        transfer_tokens=tokens,
        decode_running=0,
        decode_waiting=0,
        pool_queued_tokens=0,
        prefill_rate=4000.0,
        local_rate=4000.0,
        link_rate=2e9,
        kv_bytes_per_token=KV_PER_TOKEN,
    )
    return replace(base, **kw)


CAP = 4096  # no cap in the threshold tests below unless they say so


def test_a_short_prompt_goes_local_and_a_long_one_remote_when_decodes_run():
    # idle decode worker: the same compute, minus the transfer: local
    assert prefill_locally(inputs(32), CAP)
    # 4 decodes running: a 32-token prompt stalls them 8 ms each; remote pays 8 ms + 3 ms of KV
    assert not prefill_locally(inputs(32, decode_running=4), CAP)
    # ... unless the pool is backed up: 800 tokens queued ahead are 200 ms of waiting
    assert prefill_locally(inputs(32, decode_running=4, pool_queued_tokens=800), CAP)
    # a long prompt with decodes running stalls them all for its whole compute: remote
    assert not prefill_locally(inputs(1024, decode_running=4, pool_queued_tokens=800), CAP)
    c = placement_costs(inputs(1024, decode_running=4, pool_queued_tokens=800))
    assert c.local_s == pytest.approx(0.256) and c.local_cost == pytest.approx(5 * 0.256)
    assert c.remote_s == pytest.approx(1824 / 4000 + 1024 * KV_PER_TOKEN / 2e9)


def test_a_long_prompt_goes_local_when_the_pool_is_backed_up_and_the_link_fast():
    x = inputs(1024, decode_running=2, pool_queued_tokens=8000)  # 2 s of prompts queued at P
    assert prefill_locally(x, CAP)  # local: 0.256 s x 3 = 0.77 s < 2.26 s + transfer
    assert not prefill_locally(replace(x, pool_queued_tokens=1000), CAP)  # 0.5 s queued: remote
    # a slow link makes a long remote prefill dearer still: 1024 x 196 KB at 50 MB/s is 4 s
    assert prefill_locally(replace(x, pool_queued_tokens=1000, link_rate=5e7), CAP)


def test_a_busy_decode_worker_pushes_prompts_remote():
    x = inputs(64, pool_queued_tokens=400)  # 100 ms queued at P
    running = [n for n in range(0, 64) if prefill_locally(replace(x, decode_running=n), CAP)]
    assert running == list(range(0, 7))  # 16 ms x (1 + n) < 116 ms + 6 ms transfer up to n = 6
    assert not prefill_locally(replace(x, decode_waiting=1), CAP)  # another prompt waits there: never
    assert not prefill_locally(replace(x, local_rate=400.0), CAP)  # its own prefill is slow (measured)


def test_the_cap_is_the_longest_local_prefill():
    x = inputs(200, decode_running=1, pool_queued_tokens=100_000)  # local is far cheaper
    assert prefill_locally(x, 200) and not prefill_locally(x, 199) and not prefill_locally(x, 0)


def test_the_router_offers_per_placement_and_policy():
    short, long_ = inputs(32), inputs(1024, decode_running=4)
    auto = Router("kv-aware", local_prefill_max_tokens=128, placement="auto")
    assert auto.weighs_placement
    assert auto.local_prefill_offer(0, 32, short) == 128  # uncached, and cheaper locally
    assert auto.local_prefill_offer(0, 1024, long_) == 0
    assert auto.local_prefill_offer(0, 32, None) == 0  # no prefill worker to weigh against
    remote = Router("kv-aware", local_prefill_max_tokens=128, placement="remote")
    assert remote.local_prefill_offer(0, 32, short) == 0  # uncached: always the pool
    assert remote.local_prefill_offer(512, 544, None) == 128  # a held short rest: as before auto
    local = Router("kv-aware", placement="local")
    assert local.local_prefill_offer(0, 1024, long_) == LOCAL_ALWAYS_MAX_TOKENS
    for policy in ("least-loaded", "round-robin"):
        assert not Router(policy, placement="auto").weighs_placement  # type: ignore[arg-type]
        assert Router(policy, placement="auto").local_prefill_offer(0, 32, short) == 0  # type: ignore[arg-type]
        assert Router(policy, placement="local").local_prefill_offer(0, 32, None) == LOCAL_ALWAYS_MAX_TOKENS  # type: ignore[arg-type]


def test_rates_are_measured_from_first_outputs_with_defaults_before():
    r = PlacementRates()
    assert r.prefill.rate == r.local_rate(0.0) == DEFAULT_PREFILL_TOKENS_PER_S
    r.observe_remote("p", 1000, {"prefill_compute_s": 0.5, "kv_transfer_s": 0.1, "kv_bytes": 1e8}, now=10.0)
    assert r.prefill.rate == pytest.approx(2000) and r.link.rate == pytest.approx(1e9)
    assert r.local_rate(10.0) == pytest.approx(2000)  # not measured on a decode worker yet: the pool's
    # a second prompt of the same batch ends 10 ms later: 10 ms of busy time, not its 0.5 s again
    r.observe_remote("p", 1000, {"prefill_compute_s": 0.51}, now=10.01)
    assert r.prefill.rate == pytest.approx((1000) / (0.8 * 0.5 + 0.2 * 0.01))
    r.observe_local("d", 64, started=20.0, now=20.2)
    assert r.local_rate(20.2) == pytest.approx(320)
    assert r.local_rate(20.2 + LOCAL_RATE_TTL_S + 1) == r.prefill.rate  # stale: tried again at the pool's
    assert kv_bytes_per_token(24, 8, 64, "float32") == KV_PER_TOKEN
    assert kv_bytes_per_token(24, 8, 64, "bfloat16") == KV_PER_TOKEN // 2


class RecordingPlane:
    """The gateway's worker plane, recording what it would send."""

    addr = "ipc://gw"

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send(self, worker_id: str, msg: object) -> None:
        self.sent.append((worker_id, msg))


def _cluster(placement: str) -> tuple[DisaggregatedFlow, RecordingPlane, WorkerEntry, WorkerEntry]:
    plane = RecordingPlane()
    table = WorkerTable(dead_after_s=60)
    p = WorkerEntry(fake_worker("p-1", "prefill", "ipc://p", num_blocks=256))
    d = WorkerEntry(fake_worker("d-1", "decode", "ipc://d", num_blocks=256), WorkerStats(kv_blocks_free=256))
    table.workers.update({"p-1": p, "d-1": d})
    members = ClusterMembers(plane, "gw", table, lambda: None)  # type: ignore[arg-type]
    flow = single_try_flow(members, Router("kv-aware", local_prefill_max_tokens=128, placement=placement))  # type: ignore[arg-type]
    return flow, plane, p, d


def _reserve(placement: str, prompt_len: int, answer) -> tuple[ReserveRequest, tuple]:
    """Start a request's pair on the simulated cluster; the decode worker answers `answer(req)`."""

    async def run():
        flow, plane, _, _ = _cluster(placement)
        rec = RequestRecord("r", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=4), OutputStream())
        rec.begin_attempt()
        flow.requests.add(rec)
        task = asyncio.create_task(flow._start_pair(rec, rec.prompt))
        for _ in range(1000):
            if plane.sent or task.done():
                break
            await asyncio.sleep(0.001)
        if task.done():
            task.result()  # (raises what went wrong)
        ((to, req),) = plane.sent
        assert to == "d-1" and isinstance(req, ReserveRequest)
        assert rec.reservation is not None
        rec.reservation.set_result(answer(req))
        p, d, reply = await task
        return req, (p.worker_id if p else None, d.worker_id, reply, rec.local_since > 0)

    return asyncio.run(run())


def _lease(req: ReserveRequest) -> ReserveReply:
    lease = Lease(epoch=1, block_ids=[0, 1, 2], deadline=time.time() + 30)
    return ReserveReply(request_id=req.request_id, worker_id="d-1", lease=lease)


def test_an_uncached_short_prompt_is_offered_to_the_decode_worker_and_taken():
    req, (p, d, reply, local) = _reserve(
        "auto", 40, lambda r: ReserveReply(request_id=r.request_id, worker_id="d-1", local=True)
    )
    assert req.local_prefill_max_tokens == 128 and not req.local_prefill_always
    assert len(req.prompt_token_ids) == 40 and req.sampling is not None  # what it needs to prefill it
    assert (p, d, reply.local, local) == (None, "d-1", True, True)  # no prefill worker holds it


def test_a_decode_worker_refusing_the_local_prefill_falls_back_to_the_pool():
    # the decode worker had a prompt waiting (its own check): it grants a lease instead
    req, (p, d, reply, local) = _reserve("auto", 40, _lease)
    assert req.local_prefill_max_tokens == 128
    assert (p, d, reply.lease is not None, local) == ("p-1", "d-1", True, False)


def test_placements_remote_and_local_offer_nothing_and_everything():
    req, (p, *_) = _reserve("remote", 40, _lease)
    assert req.local_prefill_max_tokens == 0 and req.prompt_token_ids == [] and p == "p-1"
    req, _ = _reserve("auto", 300, _lease)  # over the cap: the pool
    assert req.local_prefill_max_tokens == 0 and req.prompt_token_ids == []
    req, (p, *_) = _reserve("local", 300, lambda r: ReserveReply(request_id=r.request_id, worker_id="d-1", local=True))
    assert req.local_prefill_max_tokens == LOCAL_ALWAYS_MAX_TOKENS and req.local_prefill_always and p is None
