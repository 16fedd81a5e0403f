"""Where each worker's machine-dependent defaults are decided, once: step budgets, idle lanes,
thread lending, decode step pacing. `pdserve serve` knows every worker it starts on this
machine; a worker started alone (`pdserve prefill|decode|colocated`) plans as the only worker
on its machine. Both then build the same settings struct (runtime/worker_settings.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CPU_PREFILL_BUDGET = 512
DEFAULT_BUDGET = 2048
PACING_SHARE_OF_TPOT = 0.6  # of the TPOT target: 36 ms of 60, the rest is headroom for jitter


def cpu_count() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Topology:
    """The workers sharing this machine's cores."""

    cpus: int
    prefill_workers: int = 0
    decode_workers: int = 0
    colocated: bool = False
    threads: int | None = None  # every worker's torch threads (None: cores / workers)
    prefill_threads: int | None = None  # per prefill worker (None: `threads`)
    decode_threads: int | None = None  # per decode worker (None: `threads`)

    @classmethod
    def alone(cls, role: str, threads: int | None) -> "Topology":
        """A worker started by itself: the only one on its machine."""
        return cls(
            cpus=cpu_count(),
            prefill_workers=int(role == "prefill"),
            decode_workers=int(role == "decode"),
            colocated=role == "colocated",
            threads=threads or cpu_count(),
        )

    @property
    def num_workers(self) -> int:
        return 1 if self.colocated else self.prefill_workers + self.decode_workers

    @property
    def share(self) -> int:
        """Each worker's torch threads unless told: --threads, else the cores split evenly."""
        return self.threads or max(1, self.cpus // max(1, self.num_workers))

    @property
    def prefill_share(self) -> int:
        return self.prefill_threads or self.share

    @property
    def decode_share(self) -> int:
        return self.decode_threads or self.share


def step_budget(role: str, device: str, given: int | None) -> int:
    """Token budget of a worker's step. A prefill (or colocated) worker on CPU: 512 tokens a
    step: matmuls of 512 rows already run at full speed, and a queue's first prompts get their
    first token without waiting for the prompts batched behind them (p99 TTFT 8.2 -> 4.3 s at
    1 req/s in the 1P1D SLO sweep); a colocated worker's decodes wait behind at most 512 prompt
    tokens. Else 2048. A value given wins."""
    if given:
        return given
    return CPU_PREFILL_BUDGET if role in ("prefill", "colocated") and device == "cpu" else DEFAULT_BUDGET


def prefill_idle_lanes(topo: Topology, given: int | None = None) -> int:
    """Idle lanes per prefill worker: the machine's cores outside the prefill pool, in lanes of
    the prefill workers' thread count, shared among them (1P1D on 2 cores: 1)."""
    if given is not None:
        return given
    if topo.prefill_workers == 0:
        return 0
    spare = max(0, topo.cpus - topo.prefill_workers * topo.prefill_share)
    return spare // topo.prefill_share // topo.prefill_workers


def decode_idle_threads(topo: Topology, given: int | None = None) -> int:
    """Torch threads of a decode worker while no prefill for it is in flight: it borrows the
    prefill pool's cores then (cores / decode workers). Alone on its machine: no lending."""
    if given is not None:
        return given
    if topo.prefill_workers == 0 or topo.decode_workers == 0:
        return topo.decode_share
    return max(topo.decode_share, topo.cpus // topo.decode_workers)


def decode_step_interval_ms(topo: Topology, idle_lanes: int, tpot_slo_ms: float, given: float | None = None) -> float:
    """Decode step pacing (decode_node/step_pacing.py): the most time between decode steps
    while prompts queue for prefill. 0.6 x the TPOT target (36 ms of 60) when prefill can run
    on the decode workers' cores (idle lanes, or more prefill and decode threads than cores, as
    in 2P1D on 2 cores): the gaps between paced steps go to prefill. Else 0 (nobody to yield
    to). Pacing only spaces step starts: a step that itself takes the interval is not delayed."""
    if given is not None:
        return given
    want = topo.prefill_workers * topo.prefill_share + topo.decode_workers * topo.decode_share
    shared = topo.prefill_workers > 0 and (idle_lanes > 0 or want > topo.cpus)
    return round(PACING_SHARE_OF_TPOT * tpot_slo_ms, 1) if shared else 0.0
