"""bench-kv runs end to end at a tiny size and prints one valid JSON line."""

from __future__ import annotations

import json

from pdserve.kvtransfer.bench import bench_kv_main


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
            ]
        )
        == 0
    )
    assert "shm" in capsys.readouterr().out
    assert bench_kv_main(["--transports", "pigeon", "--tokens", "16"]) == 2
    assert bench_kv_main(["--repeat", "0"]) == 2


def test_bench_between_tp_degrees_json_tiny(capsys):
    """Every pair, over ZeroMQ and shared memory (into each decode rank pool), from rank 0 alone
    or from each prefill rank at once, moves the KV and lands each rank's heads exactly."""
    from pdserve.kvtransfer.bench_heads import main

    argv = ["--json", "--tokens", "40", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--block-size", "8"]
    assert main([*argv, "--repeat", "2", "--pairs", "1:1,2:1,1:2,2:2"]) == 0
    res = json.loads(capsys.readouterr().out.strip())
    assert res["kv_bytes"] == 2 * 2 * 5 * 8 * 2 * 8 * 4
    pairs = {"tp1-to-tp1": [""], "tp2-to-tp1": ["", "-per-rank"], "tp1-to-tp2": [""], "tp2-to-tp2": ["", "-per-rank"]}
    names = [f"{p}-{t}{r}" for p, ranks in pairs.items() for t in ("zmq-ipc", "shm") for r in ranks]
    assert list(res["pairs"]) == names  # per-rank: each prefill rank its own sender, KvRangeDone
    assert all(x["verified"] and x["gbps"] > 0 for x in res["pairs"].values())
