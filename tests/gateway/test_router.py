"""The router's policies on a simulated cluster (worker entries with chosen stats, no processes):
kv-aware follows held KV then load, least-loaded ignores what workers hold, round-robin rotates
per pool; only kv-aware offers a decode worker the short rest of a prompt it holds."""

from __future__ import annotations

import pytest

from pdserve.gateway.router import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, Router
from tests.gateway.test_kv_routing import worker


def ids(workers) -> list[str]:
    return [w.worker_id for w in workers]


def test_kv_aware_prefers_the_worker_holding_the_prompt_then_the_least_loaded():
    r = Router("kv-aware")
    a, b, c = worker("a", inflight=3), worker("b", inflight=5), worker("c", inflight=0)
    assert ids(r.decode_order([a, b, c], {"b": 4}, 160)) == ["b", "c", "a"]
    p, q = worker("p", "prefill"), worker("q", "prefill")
    assert r.pick_prefill("prefill", [p, q], {"q": 512}, {}, 600).worker_id == "q"
    assert r.pick_prefill("prefill", [p, q], {"q": 512}, {"q": 2000}, 600).worker_id == "p"  # q is busy


def test_least_loaded_ignores_what_workers_hold():
    r = Router("least-loaded")
    a, b, c = worker("a", inflight=3), worker("b", inflight=5), worker("c", inflight=0, free=50)
    d = worker("d", inflight=0, free=90)
    assert ids(r.decode_order([a, b, c, d], {"b": 8}, 160)) == ["d", "c", "a", "b"]  # load, then free KV
    p, q = worker("p", "prefill"), worker("q", "prefill")
    assert r.pick_prefill("prefill", [p, q], {"q": 512}, {"q": 100}, 600).worker_id == "p"  # cache not counted
    assert r.pick_prefill("prefill", [p, q], {}, {"p": 100}, 600).worker_id == "q"


def test_round_robin_rotates_each_pool_on_its_own():
    r = Router("round-robin")
    decodes = [worker("d2"), worker("d0"), worker("d1")]
    firsts = [r.decode_order(decodes, {"d2": 9}, 160)[0].worker_id for _ in range(6)]
    assert firsts == ["d0", "d1", "d2", "d0", "d1", "d2"]  # by id, whatever they hold
    assert ids(r.decode_order(decodes, {}, 160)) == ["d0", "d1", "d2"]  # the rest of the turn follows
    prefills = [worker("p0", "prefill"), worker("p1", "prefill")]
    assert [r.pick_prefill("prefill", prefills, {}, {"p0": 10**6}, 10).worker_id for _ in range(4)] == [
        "p0",
        "p1",
        "p0",
        "p1",
    ]  # load not counted
    colocated = [worker("c0", "colocated"), worker("c1", "colocated")]
    assert r.pick_prefill("colocated", colocated, {}, {}, 10).worker_id == "c0"  # its own rotation


@pytest.mark.parametrize("policy", ["kv-aware", "least-loaded", "round-robin"])
def test_only_kv_aware_prefills_a_short_held_rest_on_the_decode_worker(policy):
    r = Router(policy, placement="remote")  # type: ignore[arg-type]
    limit = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    offered = r.local_prefill_offer(held_tokens=512, prompt_tokens=512 + limit, x=None)
    assert offered == (limit if policy == "kv-aware" else 0)
    assert r.local_prefill_offer(512, 512 + limit + 1, None) == 0  # the rest is too long
    assert r.local_prefill_offer(0, 10, None) == 0  # nothing held: the prefill pool
    assert r.local_prefill_offer(512, 512, None) == 0  # nothing left to prefill


def test_an_unknown_policy_or_placement_is_refused():
    with pytest.raises(ValueError, match="least-loaded"):
        Router("random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="auto, remote, local"):
        Router("kv-aware", placement="sometimes")  # type: ignore[arg-type]
