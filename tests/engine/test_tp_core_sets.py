"""Cores for tensor-parallel ranks (engine/parallel/core_sets.py): the plan on machines of one
and several NUMA nodes, and a TP-2 engine whose rank processes really run on disjoint cores,
rank 0 given its cores back at close."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.engine.parallel.core_sets import numa_nodes, parse_cpu_list, plan_rank_cores
from pdserve.env import reload as reload_env
from tests.engine.tensor_parallel_models import tp_engine

TWO_SOCKETS = [list(range(0, 8)), list(range(8, 16))]


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]


def test_numa_nodes_read_from_sysfs(tmp_path: Path):
    for node, cpus in (("node1", "8-15"), ("node0", "0-7"), ("node10", "")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    assert numa_nodes(tmp_path) == TWO_SOCKETS  # by node number; a node without cores skipped
    assert numa_nodes(tmp_path / "missing") == [list(range(os.cpu_count() or 1))]


@pytest.mark.parametrize(
    "allowed,nodes,ranks,want",
    [
        # one node: contiguous runs of cores
        (set(range(4)), [list(range(4))], 2, [[0, 1], [2, 3]]),
        ({0, 1}, [[0, 1]], 2, [[0], [1]]),
        (set(range(5)), [list(range(5))], 2, [[0, 1, 2], [3, 4]]),
        # as many nodes as ranks: a node each
        (set(range(16)), TWO_SOCKETS, 2, TWO_SOCKETS),
        # more nodes than ranks: whole nodes, grouped
        (set(range(8)), [[0, 1], [2, 3], [4, 5], [6, 7]], 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # cores sysfs places in no node: a node of their own
        (set(range(4)), [[0, 1]], 2, [[0, 1], [2, 3]]),
        # fewer nodes: each node split among its ranks
        (set(range(16)), TWO_SOCKETS, 4, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]),
        # a mask that leaves one core of node 1: nodes as the mask sees them
        ({0, 1, 2, 3, 8}, TWO_SOCKETS, 2, [[0, 1, 2, 3], [8]]),
        # uneven: 3 ranks on two nodes of 8 -> contiguous runs
        (set(range(16)), TWO_SOCKETS, 3, [list(range(0, 6)), list(range(6, 11)), list(range(11, 16))]),
    ],
)
def test_each_rank_gets_its_own_cores_and_node(allowed, nodes, ranks, want):
    plan = plan_rank_cores(allowed, nodes, ranks)
    assert plan == want
    flat = [c for cores in plan for c in cores]
    assert len(flat) == len(set(flat)) and set(flat) <= allowed and all(plan)


def test_fewer_cores_than_ranks_pins_nothing():
    assert plan_rank_cores({0}, [[0, 1]], 2) is None


def allowed_cores(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    raise AssertionError("no Cpus_allowed_list")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_tp2_engine_runs_its_ranks_on_disjoint_cores(tiny_llama):
    before = sorted(os.sched_getaffinity(0))
    engine = tp_engine(tiny_llama, 2)
    try:
        (rank1,) = engine.runner.ranks.pids  # type: ignore[attr-defined]
        rank0_cores, rank1_cores = sorted(os.sched_getaffinity(0)), allowed_cores(rank1)
        assert rank0_cores and rank1_cores and not set(rank0_cores) & set(rank1_cores)
        assert set(rank0_cores) | set(rank1_cores) == set(before)
        for tid in os.listdir("/proc/self/task"):  # every thread of rank 0, torch's pool included
            assert allowed_cores(int(tid)) == rank0_cores
    finally:
        engine.close()
    assert sorted(os.sched_getaffinity(0)) == before  # rank 0's process has its cores back


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinning_can_be_turned_off(tiny_llama, monkeypatch):
    monkeypatch.setenv("PDSERVE_TP_CORES", "off")
    reload_env()
    before = sorted(os.sched_getaffinity(0))
    engine = tp_engine(tiny_llama, 2)
    try:
        (rank1,) = engine.runner.ranks.pids  # type: ignore[attr-defined]
        assert sorted(os.sched_getaffinity(0)) == before and allowed_cores(rank1) == before
    finally:
        engine.close()
