"""The planner's fit and simulation on synthetic costs, without a model: the figures a single
request must get, queueing, chunking, admission, shared cores, and speed at cluster scale."""

from __future__ import annotations

import time

import pytest

from pdserve.planner.cli import main as plan_main
from pdserve.planner.cli import parse_layout, workload
from pdserve.planner.costs import CostModel, Linear, ThreadCosts, fit, load, save
from pdserve.planner.simulate import Layout, Limits, Simulation, attainment

# 1 ms + 10 us a prompt token (no attention term); 2 ms + 0.5 ms a decoding sequence
ONE = ThreadCosts(prefill=Linear(0.001, [1e-5, 0.0]), decode=Linear(0.002, [5e-4, 0.0]))
TWO = ThreadCosts(prefill=Linear(0.001, [5e-6, 0.0]), decode=Linear(0.002, [2.5e-4, 0.0]))
COSTS = CostModel(
    model="synthetic", machine="test", block_size=16, kv_bytes_per_token=0, num_layers=1,
    transfer_gbps=10.0, by_threads={1: ONE, 2: TWO},
)  # fmt: skip


def run(layout: Layout, reqs, limits: Limits = Limits()):
    return Simulation(COSTS, layout, limits).run(reqs)


def test_fit_recovers_known_costs():
    rows = [(t, t * t / 2) for t in (16, 64, 128, 256, 512)]
    times = [0.002 + 1e-5 * t + 1e-8 * p for t, p in rows]
    got = fit(rows, times)
    assert got.intercept == pytest.approx(0.002, rel=1e-6)
    assert got.coefs == pytest.approx([1e-5, 1e-8], rel=1e-6)
    assert got.rms_error_s < 1e-9


def test_one_request_gets_its_prefill_and_decode_costs():
    (r,) = run(Layout(1, 1), [(0.0, 100, 5)])
    assert r.ttft == pytest.approx(0.001 + 100e-5)
    assert r.tpot == pytest.approx(0.002 + 5e-4)  # four decode steps of one sequence
    (r,) = run(Layout(1, 1), [(0.0, 1200, 2)])  # three chunks of at most 512
    assert r.ttft == pytest.approx(3 * 0.001 + 1200e-5)


def test_queueing_admission_and_colocated_steps():
    a, b = run(Layout(1, 1), [(0.0, 400, 3), (0.0, 400, 3)])
    assert a.ttft == pytest.approx(0.001 + 400e-5)  # a's step starts as it arrives, alone
    assert b.ttft == pytest.approx(2 * (0.001 + 400e-5))  # b waits for it
    one_seat = Limits(max_num_seqs=1)
    a, b = run(Layout(1, 1), [(0.0, 10, 4), (0.0, 10, 4)], one_seat)
    assert b.arrival + b.ttft > a.finish  # admitted only once a left its seat
    (c,) = run(Layout(0, 0, colocated=1), [(0.0, 100, 3)])
    assert c.ttft == pytest.approx(0.001 + 100e-5) and c.tpot == pytest.approx(0.0025)


def test_workers_sharing_a_machine_slow_each_other():
    reqs = workload(200, 20.0, 512, 64, 0.5, seed=3)
    shared = run(Layout(1, 1, machine_cores=2), reqs)
    own = run(Layout(1, 1, cores_per_worker=2), reqs)
    assert sum(r.finish for r in shared) > sum(r.finish for r in own)
    alone = run(Layout(1, 1, machine_cores=2), [(0.0, 100, 2)])[0]
    assert alone.ttft == pytest.approx(0.001 + 100 * 5e-6)  # alone it has both cores


def test_more_workers_never_hurt_and_capacity_is_found():
    reqs = workload(400, 60.0, 512, 64, 0.5, seed=4)
    small = attainment(run(Layout(1, 1, cores_per_worker=1), reqs), 2.0, 0.06)
    big = attainment(run(Layout(3, 2, cores_per_worker=1), reqs), 2.0, 0.06)
    assert small < 0.9 <= big


def test_two_hundred_workers_at_cluster_rate_in_under_a_minute():
    reqs = workload(20_000, 400.0, 1024, 128, 0.5, seed=5)
    started = time.monotonic()
    done = run(Layout(80, 120, cores_per_worker=1), reqs)
    assert time.monotonic() - started < 60
    assert all(r.finish == r.finish for r in done)  # every request finished (no NaN)


def test_plan_command_picks_the_cheapest_layout(tmp_path, capsys):
    path = tmp_path / "costs.json"
    save(COSTS, str(path))
    assert load(str(path)) == COSTS
    assert plan_main(["--costs", str(path), "--rate", "60", "--num-prompts", "300", "--input-len", "512",
                      "--output-len", "64", "--range-ratio", "0.5", "--max-prefill", "3", "--max-decode", "3",
                      "--cores-per-worker", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "cheapest meeting 90%" in out and "| 1P1D | 2 |" in out
    assert parse_layout("2P1D", None, 1).name == "2P1D" and parse_layout("colocated", 2, 1).colocated == 1


def test_calibration_reads_the_most_loaded_passing_run(tmp_path):
    import json

    from pdserve.planner.cli import calibration

    def run(rate, att, prefill, gateway):
        return {
            "request_rate": rate,
            "goodput_attainment": att,
            "completed": 10,
            "total_input_tokens": 5120,  # 512 a request
            "server_cpu_s_per_request_by_role": {"prefill": prefill, "gateway": gateway, "decode": 0.3},
        }

    results = {"pdserve-1P1D": {"sweep": [run(1, 1.0, 0.5, 0.05), run(2, 0.95, 0.2, 0.02), run(3, 0.4, 0.1, 0.01)]}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    overhead, gateway, where = calibration(str(path), "pdserve-1P1D", COSTS, 0.9)
    per_token = ONE.prefill_s(512, 512 * 256) / 512
    assert overhead == pytest.approx(0.2 / 512 / per_token) and gateway == 0.02 and "2 req/s" in where


def test_prefill_overhead_and_gateway_load_slow_a_shared_machine():
    reqs = workload(300, 30.0, 512, 32, 0.5, seed=6)
    plain = run(Layout(1, 1, machine_cores=2), reqs)
    heavier = run(Layout(1, 1, machine_cores=2), reqs, Limits(prefill_overhead=1.5, gateway_core_s=0.01))
    assert sum(r.ttft for r in heavier) > sum(r.ttft for r in plain)
