"""The bench's own arithmetic on synthetic timings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.metrics import RequestResult, compute_metrics
from pdserve.bench.plots import plot_sweep
from pdserve.bench.sweep import capacity


def results():
    return [
        RequestResult(True, 10, 5, ttft=0.1, itl=[0.02, 0.02, 0.02, 0.02], latency=0.18),
        RequestResult(True, 20, 1, ttft=0.3, itl=[], latency=0.3),  # one token: no TPOT
        RequestResult(True, 30, 3, ttft=0.2, itl=[0.05, 0.05], latency=0.3),
        RequestResult(False, 40, error="HTTP 503"),
    ]


def test_counts_throughput_and_percentiles():
    m = compute_metrics(results(), duration_s=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(4.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(float(np.percentile([100, 300, 200], 99)))
    assert m["mean_e2el_ms"] == pytest.approx((180 + 300 + 300) / 3)


def test_tpot_excludes_first_token_and_itl_is_pooled():
    m = compute_metrics(results(), duration_s=1.0)
    # (0.18 - 0.1) / 4 = 20 ms ; (0.3 - 0.2) / 2 = 50 ms ; the 1-token request has no TPOT
    assert m["mean_tpot_ms"] == pytest.approx(35.0)
    assert m["mean_itl_ms"] == pytest.approx((4 * 20 + 2 * 50) / 6)
    assert m["median_itl_ms"] == pytest.approx(20.0)


@pytest.mark.parametrize(
    "slos,good",
    [({"ttft": 250}, 2), ({"tpot": 30}, 2), ({"e2el": 200}, 1), ({"ttft": 250, "tpot": 30}, 1), ({"ttft": 1000}, 3)],
)
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    m = compute_metrics(results(), duration_s=2.0, goodput_slos_ms=slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)
    assert m["goodput_attainment"] == pytest.approx(good / 4)  # failed requests count as missed


def test_poisson_and_gamma_arrivals():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    poisson = np.diff(arrival_offsets(20000, rate=4.0, burstiness=1.0, seed=1))
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)
    bursty = np.diff(arrival_offsets(20000, rate=4.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.25, rel=0.06)
    assert bursty.std() > 1.8 * poisson.std()  # burstier: same mean, larger variance
    assert arrival_offsets(10, 2.0, seed=3) == arrival_offsets(10, 2.0, seed=3)


def test_capacity_is_highest_rate_before_attainment_drops():
    assert capacity([(0.5, 1.0), (1, 0.95), (2, 0.91), (4, 0.5), (8, 0.95)]) == 2
    assert capacity([(0.5, 0.8), (1, 0.95)]) is None


def test_plots_are_written(tmp_path):
    rows = [
        {
            "label": lbl,
            "request_rate": r,
            "goodput_attainment": a,
            "request_goodput": r * a,
            "median_ttft_ms": 100 * r,
            "p99_ttft_ms": 150 * r,
            "median_tpot_ms": 20,
            "p99_tpot_ms": 30,
        }
        for lbl in ("pdserve", "peer")
        for r, a in ((0.5, 1.0), (1, 0.9), (2, 0.4))
    ]
    paths = plot_sweep(rows, tmp_path, "(ttft <= 2000 ms)")
    assert {p.name for p in paths} == {"slo_attainment.png", "goodput.png", "ttft.png", "tpot.png"}
    assert all(p.stat().st_size > 5000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_goal2_verdict_compares_capacity_and_tpot():
    from pdserve.bench.compare import goal2_verdict

    def server(cap, tpot):
        return {"capacity_req_s": cap, "sweep": [{"p99_tpot_ms": tpot}]}

    met = goal2_verdict(
        {"pdserve-1P1D": server(1.25, 9.0), "llama.cpp": server(1.0, 10.0), "pdserve-colocated": server(0.75, 30.0)}
    )[1]
    assert "1.25x -> **met**" in met and "lower than every other -> **met**" in met
    missed = goal2_verdict({"pdserve-1P1D": server(1.0, 12.0), "llama.cpp": server(1.0, 8.0)})[1]
    assert "1.00x -> **not met**" in missed and "(not lower than llama.cpp)" in missed
    nobody = goal2_verdict({"pdserve-1P1D": server(None, 9.0), "vllm-cpu": server(None, 20.0)})[1]
    assert "capacity 0 req/s" in nobody and "-> **not met**; p99" in nobody  # no capacity is no win
    # 2P1D is reported beside 1P1D, measured against colocated and the peers, never against 1P1D
    both = goal2_verdict(
        {"pdserve-1P1D": server(1.0, 9.0), "pdserve-2P1D": server(1.5, 12.0), "llama.cpp": server(1.0, 10.0)}
    )
    assert both[1].startswith("Goal 2: pdserve 1P1D") and "1.00x -> **not met**" in both[1]
    assert both[3].startswith("Beside it, pdserve 2P1D") and "1.50x -> **met**" in both[3]
    assert "(not lower than llama.cpp)" in both[3]


def test_goal1_verdict_needs_both_parts_from_one_configuration():
    from pdserve.bench.compare import goal1_verdict

    def burst(tok_s, x_bound):
        return {"burst": {"output_throughput": tok_s, "x_flop_bound": x_bound}}

    lines = goal1_verdict(
        {
            "pdserve-1P1D": burst(130.0, 2.5),
            "pdserve-colocated": burst(126.0, 1.9),
            "llama.cpp": burst(100.0, 3.0),
            "vllm-cpu": burst(90.0, 3.2),
        }
    )
    assert (
        "pdserve-1P1D >= 1.25x the best peer: 1.30x -> **met**; within 2x of the FLOP bound: 2.50x -> **not met**."
        in lines
    )
    assert lines[-1].endswith("**met** by pdserve-colocated.")  # 1.26x and 1.90x, against llama.cpp
    split = goal1_verdict(
        {"pdserve-1P1D": burst(130.0, 2.5), "pdserve-2P1D": burst(110.0, 1.8), "llama.cpp": burst(100.0, 3.0)}
    )
    assert split[-1].endswith("**not met**.")  # throughput from one, the bound from another: no
    assert goal1_verdict({"pdserve-1P1D": burst(130.0, 1.5)}) == []  # no peer measured: no verdict


def test_median_burst_takes_the_median_ratio_not_the_median_rounds():
    """tok/s from the median round; x FLOP bound the median of every round's own ratio (the
    median-throughput round's ceiling can be the outlier)."""
    from pdserve.bench.compare import median_burst

    runs = [
        {"output_throughput": t, "duration": d, "x_flop_bound": x, "failed": 0}
        for t, d, x in ((414.0, 7.9, 2.02), (432.0, 7.5, 1.76), (445.0, 7.3, 2.08))
    ]
    med = median_burst(runs)
    assert med["output_throughput"] == 432.0 and med["duration"] == 7.5
    assert med["x_flop_bound"] == 2.02
    assert [r["x_flop_bound"] for r in med["runs"]] == [2.02, 1.76, 2.08]


def test_goal2_verdict_weighs_the_target_against_the_prefill_pool():
    from pdserve.bench.compare import cpu_per_request, goal2_verdict, pool_cores

    def server(cap, costs):  # costs: (all processes, prefill) core-s per request, one per rate
        return {
            "capacity_req_s": cap,
            "sweep": [
                {
                    "p99_tpot_ms": 20.0,
                    "completed": 8,
                    "server_cpu_s_per_request": c,
                    "server_cpu_s_per_request_by_role": {"prefill": p, "decode": c - p},
                }
                for c, p in costs
            ],
        }

    sweep = server(1.0, [(1.2, 0.5), (0.9, 0.4), (1.0, 0.45)])["sweep"]
    assert cpu_per_request(sweep) == 1.0 and cpu_per_request(sweep, "prefill") == 0.45  # medians
    assert cpu_per_request(sweep, "gateway") == 0.0  # a role that took nothing
    assert cpu_per_request([{"completed": 0, "server_cpu_s_per_request": 0.1}]) is None
    assert pool_cores("pdserve-1P1D", 2) == (1, 1) and pool_cores("pdserve-2P1D", 2) == (2, 1)
    assert pool_cores("pdserve-1P3D", 8) == (2, 6) and pool_cores("pdserve-colocated", 2) is None
    lines = goal2_verdict(
        {"pdserve-1P1D": server(1.0, [(1.0, 0.5)]), "pdserve-colocated": server(2.0, [(0.8, 0.0)])}, cores=2
    )
    # target 1.25 x 2 = 2.5 req/s: 2.5 of the 2 cores, and the one prefill core 125% busy
    assert lines[2] == (
        "At its measured cost (median over the sweep) of 1.00 core-s per request, 0.50 of them in the "
        "prefill pool, the target 2.5 req/s keeps 2.50 of the machine's 2 cores busy, and its prefill "
        "pool's 1 core(s) 125% busy (beyond the pool)."
    )
    fits = goal2_verdict(
        {"pdserve-1P1D": server(1.0, [(0.5, 0.2)]), "pdserve-colocated": server(1.0, [(0.8, 0.0)])}, cores=2
    )
    assert fits[2].endswith("and its prefill pool's 1 core(s) 25% busy.")


def test_burst_rounds_alternate_the_order():
    from pdserve.bench.compare import round_order

    assert [round_order(["a", "b", "c"], k) for k in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
