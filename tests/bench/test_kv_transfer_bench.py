"""bench-kv runs end to end at a tiny size and prints one valid JSON line; it moves the KV with the
workers' copy (pdserve/worker_process.py) whether started as `pdserve bench-kv` or as
`python -m pdserve.bench.kv_transfer`."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.kv_transfer import bench_kv_main
from pdserve.kernels import stream_copy
from pdserve.kvtransfer import sender


@pytest.fixture(autouse=True)
def _process_copy(monkeypatch):
    """Each test starts with the process default (memmove) and leaves it so."""
    monkeypatch.setattr(sender, "_contiguous_copy", sender._memmove)


def test_bench_kv_json_tiny(capsys):
    rc = bench_kv_main(
        [
            "--json",
            "--tokens",
            "40",
            "--layers",
            "2",
            "--kv-heads",
            "2",
            "--head-dim",
            "8",
            "--block-size",
            "8",
            "--repeat",
            "2",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(out) == 1
    res = json.loads(out[0])
    assert res["config"]["contiguous_copy"] == "streaming"  # the workers' copy, with no CLI in between
    assert sender._contiguous_copy is stream_copy.copy_addr
    assert res["kv_bytes"] == 2 * 2 * 5 * 8 * 2 * 8 * 4 and res["memcpy_gbps"] > 0
    assert set(res["transports"]) == {"zmq-tcp", "zmq-tcp-clear", "zmq-ipc", "shm"} == set(res["ratios"])
    for t in res["transports"].values():
        assert t["verified"] and t["gbps"] > 0 and t["seconds"] > 0 and t["dropped"] == 0
    encrypted = {name: t["encrypted"] for name, t in res["transports"].items()}
    assert encrypted == {"zmq-tcp": True, "zmq-tcp-clear": False, "zmq-ipc": False, "shm": False}
    # with zmq-ipc, the bare Unix socket's rate beside it (the ceiling of a socket transport)
    assert res["unix_socket_gbps"] > 0
    assert res["unix_socket_ratio"] == res["unix_socket_gbps"] / res["memcpy_gbps"]


def test_bench_kv_table_and_bad_args(capsys):
    assert (
        bench_kv_main(
            [
                "--tokens",
                "16",
                "--layers",
                "1",
                "--kv-heads",
                "1",
                "--head-dim",
                "4",
                "--repeat",
                "1",
                "--transports",
                "shm",
                "--scattered",
                "--dtype",
                "bfloat16",
                "--contiguous-copy",
                "memmove",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "shm" in out and "block copies: memmove" in out
    assert sender._contiguous_copy is sender._memmove
    assert bench_kv_main(["--transports", "pigeon", "--tokens", "16"]) == 2
    assert bench_kv_main(["--repeat", "0"]) == 2


def test_bench_between_tp_degrees_json_tiny(capsys):
    """Every pair, over ZeroMQ and shared memory (into each decode rank pool), from rank 0 alone
    or from each prefill rank at once, moves the KV and lands each rank's heads exactly."""
    from pdserve.bench.kv_heads import main

    argv = ["--json", "--tokens", "40", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--block-size", "8"]
    assert main([*argv, "--repeat", "2", "--pairs", "1:1,2:1,1:2,2:2"]) == 0
    res = json.loads(capsys.readouterr().out.strip())
    assert res["kv_bytes"] == 2 * 2 * 5 * 8 * 2 * 8 * 4
    pairs = {"tp1-to-tp1": [""], "tp2-to-tp1": ["", "-per-rank"], "tp1-to-tp2": [""], "tp2-to-tp2": ["", "-per-rank"]}
    names = [f"{p}-{t}{r}" for p, ranks in pairs.items() for t in ("zmq-ipc", "shm") for r in ranks]
    assert list(res["pairs"]) == names  # per-rank: each prefill rank its own sender, KvRangeDone
    assert all(x["verified"] and x["gbps"] > 0 for x in res["pairs"].values())


def test_the_module_run_directly_configures_as_the_workers():
    """`python -m pdserve.bench.kv_transfer` (no CLI) reports the workers' streaming copy."""
    import subprocess
    import sys

    argv = ["--json", "--tokens", "16", "--layers", "1", "--kv-heads", "1", "--head-dim", "4", "--repeat", "1"]
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.kv_transfer", *argv, "--transports", "shm"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["config"]["contiguous_copy"] == "streaming"
