"""Which CPU cores each tensor-parallel rank runs on: its own, and its own NUMA node where the
machine has several (as vLLM's CPU backend runs one rank per node).

The worker's allowed cores (its affinity mask: what `taskset`, a container or `serve` left it) are
split into one disjoint set per rank. With at least as many NUMA nodes as ranks, each rank takes
whole nodes (its weights, KV pool and threads then stay on one memory controller); with fewer
nodes, each node's cores are split evenly among the ranks it holds; otherwise contiguous runs of
cores. With fewer cores than ranks nothing is pinned (the ranks would have to share anyway).
`PDSERVE_TP_CORES=off` turns pinning off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: Path = NODES) -> list[list[int]]:
    """Each NUMA node's cores, by node number; one node holding every core where sysfs says nothing."""
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpu_list((path / "cpulist").read_text())
        except OSError:
            continue
        if cpus:
            nodes.append(cpus)
    return nodes or [sorted(range(os.cpu_count() or 1))]


def _split(items: list[T], parts: int) -> list[list[T]]:
    """`items` in `parts` contiguous runs, sizes differing by at most one (the first ones longer)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out


def plan_rank_cores(allowed: set[int], nodes: list[list[int]], ranks: int) -> list[list[int]] | None:
    """One disjoint, non-empty core list per rank from the `allowed` cores; None: no pinning."""
    if ranks < 1 or len(allowed) < ranks:
        return None
    local = [[c for c in node if c in allowed] for node in nodes]
    local = [node for node in local if node]
    if sum(map(len, local)) < len(allowed):  # cores sysfs did not place: one node of their own
        placed = {c for node in local for c in node}
        local.append(sorted(allowed - placed))
    if len(local) >= ranks:  # whole nodes per rank
        return [sorted(c for node in group for c in node) for group in _split(local, ranks)]
    if ranks % len(local) == 0 and all(len(node) >= ranks // len(local) for node in local):
        return [part for node in local for part in _split(node, ranks // len(local))]
    return _split(sorted(allowed), ranks)


def rank_cores(ranks: int) -> list[list[int]] | None:
    """The plan for this process's allowed cores and this machine's nodes (None: leave unpinned)."""
    from pdserve.env import settings

    if settings().tp_cores == "off" or not hasattr(os, "sched_getaffinity"):
        return None
    return plan_rank_cores(set(os.sched_getaffinity(0)), numa_nodes(), ranks)


def pin(cpus: list[int] | None) -> list[int] | None:
    """Run this process on `cpus`: every thread it has (torch's OpenMP pool may exist already)
    and every thread it starts later. Returns the cores it ran on before, for `pin(previous)` to
    undo it (rank 0 is a process that outlives its engine: a test runner, say); nothing is done
    and None returned when `cpus` is None or empty."""
    if not cpus:
        return None
    before = sorted(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
    os.sched_setaffinity(0, cpus)
    return before
