"""`pdserve plan`: how many prefill and decode workers a target rate needs under TTFT/TPOT SLOs.

    pdserve plan --model DIR --rate 40 --ttft-slo 2000 --tpot-slo 60 [--cores-per-worker 8]

Step costs come from `--costs FILE`, made on first use by timing the engine on this machine
(profile.py; ~2 minutes) and kept. A Poisson stream of the workload (`--input-len`,
`--output-len`, `--range-ratio`, as `pdserve bench` draws them) runs through a simulation of
every xPyD up to `--max-prefill` x `--max-decode` workers (simulate.py); the table gives the
predicted TTFT/TPOT percentiles and SLO attainment of each, and the cheapest (fewest workers)
whose attainment reaches `--target`. `--layouts 1P1D,2P1D,colocated --capacity` instead finds
each layout's capacity: the highest of `--rates` at which it still meets the target (and at
every lower rate), e.g. to compare with a `pdserve bench-compare --workloads sweep` run on the
same machine (`--machine-cores`: the workers share its cores, as `pdserve serve` runs them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.datasets import uniform_lengths
from pdserve.bench.sweep import capacity
from pdserve.planner.costs import CostModel, load, save
from pdserve.planner.simulate import Layout, Limits, Simulation, attainment, percentile


def workload(n: int, rate: float, input_len: int, output_len: int, ratio: float, seed: int, out_range=None):
    """(arrival, prompt, output) as `pdserve bench --dataset-name random` draws them for this
    seed (and, with `out_range`, outputs as bench-compare's sweep draws them)."""
    rng = np.random.default_rng(seed)
    prompts = uniform_lengths(rng, n, input_len, ratio)
    outputs = uniform_lengths(rng, n, output_len, ratio)
    if out_range is not None:
        rng2 = np.random.default_rng(seed + 7)
        outputs = [int(rng2.integers(out_range[0], out_range[1] + 1)) for _ in range(n)]
    return list(zip(arrival_offsets(n, rate, 1.0, seed), prompts, outputs))


def parse_layout(text: str, machine_cores: float | None, cores_per_worker: float) -> Layout:
    t = text.strip().upper()
    if t.startswith("COLOCATED"):
        return Layout(0, 0, colocated=int(t.removeprefix("COLOCATED").strip("X") or 1),
                      machine_cores=machine_cores, cores_per_worker=cores_per_worker)  # fmt: skip
    p, _, d = t.removesuffix("D").partition("P")
    return Layout(int(p), int(d), machine_cores=machine_cores, cores_per_worker=cores_per_worker)


def evaluate(costs: CostModel, layout: Layout, limits: Limits, reqs, ttft_s: float, tpot_s: float) -> dict:
    done = Simulation(costs, layout, limits).run(reqs)
    return {
        "layout": layout.name,
        "workers": layout.workers,
        "attainment": attainment(done, ttft_s, tpot_s),
        "p50_ttft_ms": 1e3 * percentile([r.ttft for r in done], 50),
        "p90_ttft_ms": 1e3 * percentile([r.ttft for r in done], 90),
        "p50_tpot_ms": 1e3 * percentile([r.tpot for r in done], 50),
        "p90_tpot_ms": 1e3 * percentile([r.tpot for r in done], 90),
    }


def calibration(results_path: str, server: str, costs: CostModel, target: float) -> tuple[float, float, str]:
    """(prefill_overhead, gateway core-s a request, where from) read from a measured sweep
    (`pdserve bench-compare --workloads sweep` results.json): the run of `server` at its highest
    rate still meeting `target`, the one closest to saturation. A served prompt token costs its
    prefill worker more CPU than the profiled step alone (its loop, lanes, KV streaming, the
    cores' other tenants): the ratio of the two is the overhead the simulation charges."""
    import json

    runs = json.loads(Path(results_path).read_text())[server]["sweep"]
    ok = [r for r in runs if r["goodput_attainment"] >= target]
    if not ok:
        raise SystemExit(f"pdserve plan: no run of {server} in {results_path} meets {target:.0%}")
    run = max(ok, key=lambda r: r["request_rate"])
    roles = run["server_cpu_s_per_request_by_role"]
    tokens = run["total_input_tokens"] / max(1, run["completed"])
    one, _ = costs.costs(1.0)
    profiled = one.prefill_s(512, 512 * 256) / 512  # a token's share of a full 512-token step
    measured = roles.get("prefill", 0.0) / tokens
    overhead = measured / profiled if measured > 0 else 1.0
    where = f"{server} at {run['request_rate']:g} req/s in {results_path}"
    return overhead, roles.get("gateway", 0.0), where


def _costs(args) -> CostModel:
    path = Path(args.costs)
    if path.is_file():
        return load(str(path))
    if not args.model:
        raise SystemExit(f"pdserve plan: no cost model at {path}; give --model to measure one on this machine")
    from pdserve.modelgen.default_model import resolve_model
    from pdserve.planner.profile import profile

    print(f"measuring step costs on this machine -> {path}", file=sys.stderr, flush=True)
    costs = profile(resolve_model(args.model), progress=lambda m: print(m, file=sys.stderr, flush=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    save(costs, str(path))
    return costs


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pdserve plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model folder to profile when --costs does not exist yet")
    ap.add_argument("--costs", default="pdserve-costs.json", help="the fitted step costs (made on first use)")
    ap.add_argument("--rate", type=float, default=None, help="requests/s to plan for (Poisson)")
    ap.add_argument("--rates", default="0.5,1,1.5,2,2.5,3,3.5,4", help="with --capacity: the rates tried")
    ap.add_argument("--capacity", action="store_true", help="each --layouts' capacity over --rates instead")
    ap.add_argument("--ttft-slo", type=float, default=2000.0, help="ms")
    ap.add_argument("--tpot-slo", type=float, default=60.0, help="ms")
    ap.add_argument("--target", type=float, default=0.9, help="SLO attainment to meet")
    ap.add_argument("--num-prompts", type=int, default=2000, help="requests simulated per rate")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--output-range", default=None, help="LO,HI: outputs uniform in it (bench-compare's sweep: 32,64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prefill", type=int, default=8)
    ap.add_argument("--max-decode", type=int, default=8)
    ap.add_argument("--layouts", default=None, help="e.g. 1P1D,2P1D,colocated (default: every xPyD up to the maxima)")
    ap.add_argument("--cores-per-worker", type=float, default=float(os.cpu_count() or 1))
    ap.add_argument("--machine-cores", type=float, default=None, help="all workers share this many cores (one machine)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per decode worker")
    ap.add_argument("--budget", type=int, default=512, help="prompt tokens per prefill step")
    ap.add_argument(
        "--calibrate",
        default=None,
        metavar="RESULTS_JSON",
        help="a measured sweep (bench-compare results.json) to calibrate the prefill overhead and the "
        "gateway's CPU from (see --calibrate-server)",
    )
    ap.add_argument("--calibrate-server", default="pdserve-1P1D")
    ap.add_argument("--prefill-overhead", type=float, default=1.0, help="served / profiled CPU a prompt token")
    ap.add_argument("--gateway-core-s", type=float, default=0.0, help="the gateway's CPU a request (shared machine)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    costs = _costs(args)
    ttft_s, tpot_s = args.ttft_slo / 1e3, args.tpot_slo / 1e3
    overhead, gateway = args.prefill_overhead, args.gateway_core_s
    if args.calibrate:
        overhead, gateway, where = calibration(args.calibrate, args.calibrate_server, costs, args.target)
        print(f"calibrated from {where}: prefill overhead x{overhead:.2f}, gateway {gateway:.3f} core-s a request",
              file=sys.stderr)  # fmt: skip
    limits = Limits(
        budget=args.budget,
        max_num_seqs=args.max_num_seqs,
        num_blocks=args.num_blocks,
        tpot_slo_s=tpot_s,
        prefill_overhead=overhead,
        gateway_core_s=gateway,
    )
    out_range = tuple(int(x) for x in args.output_range.split(",")) if args.output_range else None
    if args.layouts:
        layouts = [parse_layout(x, args.machine_cores, args.cores_per_worker) for x in args.layouts.split(",")]
    else:
        layouts = [
            Layout(p, d, machine_cores=args.machine_cores, cores_per_worker=args.cores_per_worker)
            for p in range(1, args.max_prefill + 1)
            for d in range(1, args.max_decode + 1)
        ]
    print(f"costs: {costs.model} timed on {costs.machine}", file=sys.stderr)
    if args.capacity:
        rates = [float(x) for x in args.rates.split(",")]
        print("| layout | " + " | ".join(f"{r:g}/s" for r in rates) + " | capacity req/s |")
        print("|---|" + "---:|" * (len(rates) + 1))
        for layout in layouts:
            points = []
            for i, rate in enumerate(rates):
                reqs = workload(args.num_prompts, rate, args.input_len, args.output_len, args.range_ratio,
                                args.seed + 1000 * (i + 1), out_range)  # fmt: skip
                points.append((rate, evaluate(costs, layout, limits, reqs, ttft_s, tpot_s)["attainment"]))
            cap = capacity(points, args.target)
            cells = " | ".join(f"{a:.0%}" for _, a in points)
            print(f"| {layout.name} | {cells} | {cap if cap is not None else '<' + str(rates[0])} |", flush=True)
        return 0
    if args.rate is None:
        raise SystemExit("pdserve plan: give --rate (or --capacity with --layouts)")
    reqs = workload(
        args.num_prompts, args.rate, args.input_len, args.output_len, args.range_ratio, args.seed, out_range
    )
    started = time.monotonic()
    rows = [evaluate(costs, layout, limits, reqs, ttft_s, tpot_s) for layout in layouts]
    print("| layout | workers | SLO attainment | p50 / p90 TTFT (ms) | p50 / p90 TPOT (ms) |")
    print("|---|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["workers"], r["layout"])):
        print(
            f"| {r['layout']} | {r['workers']} | {r['attainment']:.0%} | {r['p50_ttft_ms']:.0f} / {r['p90_ttft_ms']:.0f} "
            f"| {r['p50_tpot_ms']:.1f} / {r['p90_tpot_ms']:.1f} |"
        )
    meeting = [r for r in rows if r["attainment"] >= args.target]
    took = time.monotonic() - started
    if meeting:
        best = min(meeting, key=lambda r: (r["workers"], -r["attainment"]))
        print(f"\ncheapest meeting {args.target:.0%} within TTFT <= {args.ttft_slo:g} ms and TPOT <= "
              f"{args.tpot_slo:g} ms at {args.rate:g} req/s: {best['layout']} ({best['workers']} workers); "
              f"{len(rows)} layouts simulated in {took:.1f} s")  # fmt: skip
        return 0
    print(f"\nno layout up to {args.max_prefill}P{args.max_decode}D meets the target at {args.rate:g} req/s "
          f"({len(rows)} layouts simulated in {took:.1f} s)")  # fmt: skip
    return 1
