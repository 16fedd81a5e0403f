"""Decode steps by how OpenMP's idle threads wait: asleep at once (OMP_WAIT_POLICY=PASSIVE, what
`pdserve` sets: runtime/thread_waits.py), libgomp's default (a long spin, then asleep) and short
spins then asleep (GOMP_SPINCOUNT=N, --spincounts), each in a fresh process, the settings alternating,
optionally beside CPU hogs (a machine whose cores other work shares, as a prefill and a decode
worker of one host share theirs).

    python -m pdserve.bench.thread_waits --model FILE.gguf|DIR [--threads 2] [--hogs 0,1] [--rounds 3]

Prints each run's wall and CPU milliseconds per decode step (batch 1, after two warm-up steps).
`STEP` (argv: model, threads, steps[, --activation-quantization]) is also
bench/activation_quantization.py's run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

STEP = """
import json, resource, sys, time, torch
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams
model, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
activations = sys.argv[4] if len(sys.argv) > 4 else "auto"
torch.set_num_threads(threads)
cfg = EngineConfig(model=model, activation_quantization=activations, cache=CacheConfig(block_size=16, num_blocks=64),
                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=1024))
t0 = time.perf_counter()
eng = LLMEngine(cfg, show_progress=False)
load_s = time.perf_counter() - t0
eng.add_request("r", list(range(10, 60)), SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
eng.step(); eng.step()
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
for _ in range(steps):
    eng.step()
print(json.dumps({"wall_ms": 1e3 * (time.perf_counter() - t0) / steps, "cpu_ms": 1e3 * (cpu() - c0) / steps,
                  "load_s": load_s}))
"""


# how idle threads wait: the environment each setting runs under (besides the caller's); `spinN`:
# GOMP_SPINCOUNT=N (about N x 23-47 ns of spinning on a Zen 5), added by --spincounts
WAITS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "default": {}}


def waits_env(waits: str) -> dict[str, str]:
    return {"GOMP_SPINCOUNT": waits.removeprefix("spin")} if waits.startswith("spin") else WAITS[waits]


def one_run(model: str, threads: int, steps: int, waits: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | waits_env(waits)
    out = subprocess.run(
        [sys.executable, "-c", STEP, model, str(threads), str(steps)], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.thread_waits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hogs", default="0,1", help="CPU-hog processes beside the run, one setting per figure")
    ap.add_argument("--spincounts", default="2000,20000", help="short spins to compare (GOMP_SPINCOUNT values)")
    ap.add_argument("--no-default", action="store_true", help="leave out libgomp's default (a long spin)")
    args = ap.parse_args(argv)
    settings = [w for w in WAITS if not (args.no_default and w == "default")]
    settings += [f"spin{n}" for n in args.spincounts.split(",") if n]
    print(f"{args.model}: batch 1, {args.threads} threads, {args.steps} steps a run, {args.rounds} rounds alternating")
    print("hogs  waits    wall ms/step (runs)            median  cpu ms/step median")
    for hogs in (int(h) for h in args.hogs.split(",")):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            runs: dict[str, list[dict]] = {w: [] for w in settings}
            for r in range(args.rounds):
                order = settings[r % len(settings) :] + settings[: r % len(settings)]  # rotates round by round
                for waits in order:
                    runs[waits].append(one_run(args.model, args.threads, args.steps, waits))
        finally:
            for p in procs:
                p.kill()
                p.wait()
        for waits, got in runs.items():
            walls = [x["wall_ms"] for x in got]
            cpus = [x["cpu_ms"] for x in got]
            print(
                f"{hogs:4d}  {waits:9s}  {', '.join(f'{w:.0f}' for w in walls):30s}"
                f"  {statistics.median(walls):6.0f}  {statistics.median(cpus):6.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
