"""How this process's idle OpenMP threads wait: asleep (`OMP_WAIT_POLICY=PASSIVE`), not spinning.

torch's intra-op threads and the C kernels' (built with -fopenmp) spin after each parallel
region before they sleep (libgomp's default). The gateway, prefill and decode workers of one
machine share its cores: a team spinning in one process takes the cores another's working team
needs, and every barrier of a decode step (several a layer) then waits for a descheduled thread.
Measured on 2 vCPU (AVX2) with other work running, a random Llama-3.2-1B shape in Q8_0 decoding
on 2 threads: 621 ms a step spinning, 196 ms asleep (1 thread: 181-230 ms); figures in
docs/benchmarks/thread_waits.md.

libgomp reads the variable once, when it loads (torch's import): `use_passive_waits` runs first
thing in `pdserve`'s entry point, and `serve`'s children inherit it. A value the user set wins.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_WAIT_POLICY"


def use_passive_waits() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless set; False when it comes too late (torch imported)."""
    os.environ.setdefault(VARIABLE, "PASSIVE")
    return "torch" not in sys.modules
