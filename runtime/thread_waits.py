"""How this process's idle OpenMP threads wait, chosen per role before torch loads libgomp.

torch's intra-op threads and the C kernels' (built with -fopenmp) spin after each parallel region
before they sleep: libgomp's default spins ~10 ms. The gateway, prefill and decode workers of one
machine share its cores, and a team spinning in one process takes the cores another's working team
needs (measured on 2 vCPU with other work running, a 1B model decoding on 2 threads: 621 ms a step
spinning, 196 ms asleep; docs/benchmarks/thread_waits.md). So:

- decode and colocated workers spin briefly (`GOMP_SPINCOUNT=2000`, ~0.1 ms): a decode step is
  ~100 short parallel regions, and a thread still spinning when the next one starts needs no
  wake-up; between steps, and on an idle worker, threads sleep within ~0.1 ms. Served 1B Q4_K_M,
  one request at a time on a quiet 2-vCPU Zen 5: 23.4 ms a token against 29.3 asleep at once (a
  burst of 16 no slower); beside a CPU hog a step was 1.14x slower than asleep (a ~1 ms spin:
  2.2x).
- every other process (prefill workers, whose steps are long; the gateway; tools) sleeps at once
  (`OMP_WAIT_POLICY=PASSIVE`).

libgomp reads the variables once, when it loads (torch's import): `choose_thread_waits` runs first
thing in `pdserve`'s entry point. A value the user set wins (either variable). A value pdserve
chose is marked, so `serve`'s children, which inherit it, choose again for their own role.
"""

from __future__ import annotations

import os
import sys

VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
CHOSEN_MARK = "PDSERVE_THREAD_WAITS_CHOSEN"  # set beside a value pdserve chose (not the user)
SPINNING_ROLES = ("decode", "colocated")
DECODE_SPINCOUNT = "2000"  # libgomp's spin iterations (23-47 ns each on a Zen 5)


def choose_thread_waits(command: str | None) -> bool:
    """Set how idle OpenMP threads wait for a process running `command` (a `pdserve` subcommand;
    None: sleep at once), unless the user set it; False when it comes too late (torch imported)."""
    env = os.environ
    if env.get(CHOSEN_MARK):  # a parent pdserve process's choice: made again for this role
        for name in (*VARIABLES, CHOSEN_MARK):
            env.pop(name, None)
    if not any(name in env for name in VARIABLES):
        if command in SPINNING_ROLES:
            env["GOMP_SPINCOUNT"] = DECODE_SPINCOUNT
        else:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        env[CHOSEN_MARK] = "1"
    return "torch" not in sys.modules
