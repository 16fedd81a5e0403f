"""`pdserve serve` plans every child's settings for this machine (cli/topology.py): it splits
the cores between the pools, and each child starts from one typed settings file."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from pdserve.cli import serve, topology
from pdserve.cli.main import build_parser
from pdserve.cli.roles import decode_settings, prefill_settings
from pdserve.decode_node.settings import DecodeSettings
from pdserve.prefill_node.settings import PrefillSettings
from pdserve.runtime.worker_settings import read_settings


def plan(tmp_path, monkeypatch, cores: int, *flags: str) -> dict:
    monkeypatch.setattr(topology.os, "cpu_count", lambda: cores)
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), *flags])
    return {c.name: c.settings for c in serve.plan_children(args, str(tmp_path))}


@pytest.mark.parametrize("cores,threads,idle", [(2, 1, 2), (8, 4, 8)])
def test_1p1d_splits_cores_and_decode_borrows_them_when_idle(tmp_path, monkeypatch, cores, threads, idle):
    children = plan(tmp_path, monkeypatch, cores)
    assert children["prefill-0"].threads == threads
    assert children["decode-0"].threads == threads
    assert children["decode-0"].idle_threads == idle


def test_lending_can_be_turned_off_and_is_per_decode_worker(tmp_path, monkeypatch):
    children = plan(tmp_path, monkeypatch, 8, "--decode-idle-threads", "2", "--decode-threads", "2")
    assert children["decode-0"].idle_threads == 2
    children = plan(tmp_path, monkeypatch, 8, "--decode-workers", "2")
    assert children["decode-1"].idle_threads == 4  # 8 cores / 2 decode workers


@pytest.mark.parametrize(
    "cores,flags,lanes",
    [(2, (), 1), (8, (), 1), (2, ("--prefill-workers", "2"), 0), (2, ("--prefill-idle-lanes", "0"), 0)],
)
def test_prefill_idle_lanes_cover_the_cores_outside_the_prefill_pool(tmp_path, monkeypatch, cores, flags, lanes):
    children = plan(tmp_path, monkeypatch, cores, *flags)
    assert children["prefill-0"].idle_lanes == lanes


@pytest.mark.parametrize(
    "cores,flags,interval",
    [
        (2, (), 36.0),  # 1P1D: the prefill worker's idle lane takes the gaps, 0.6 x the 60 ms TPOT target
        (2, ("--tpot-slo-ms", "30"), 18.0),  # a tighter target paces closer
        (2, ("--prefill-workers", "2"), 36.0),  # 2P1D: three threads on two cores
        (2, ("--prefill-idle-lanes", "0"), 0.0),  # nobody to yield the core to
        (8, ("--decode-workers", "2", "--decode-step-interval-ms", "40"), 40.0),
    ],
)
def test_decode_steps_are_paced_when_prefill_can_use_their_cores(tmp_path, monkeypatch, cores, flags, interval):
    children = plan(tmp_path, monkeypatch, cores, *flags)
    decoders = [s for name, s in children.items() if name.startswith("decode-")]
    assert decoders and all(s.step_interval_ms == interval for s in decoders)


def test_step_budgets_per_role(tmp_path, monkeypatch):
    children = plan(tmp_path, monkeypatch, 2)
    assert children["prefill-0"].engine.scheduler.max_num_batched_tokens == 512  # CPU prefill step
    assert children["decode-0"].engine.scheduler.max_num_batched_tokens == 2048
    children = plan(tmp_path, monkeypatch, 2, "--colocated")
    assert children["colocated-0"].engine.scheduler.max_num_batched_tokens == 512
    children = plan(tmp_path, monkeypatch, 2, "--max-num-batched-tokens", "1024")
    assert children["prefill-0"].engine.scheduler.max_num_batched_tokens == 1024  # given: wins


def test_each_child_starts_from_its_settings_file(tmp_path, monkeypatch):
    monkeypatch.setattr(topology.os, "cpu_count", lambda: 2)
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--lease-ttl", "7"])
    children = {c.name: c for c in serve.plan_children(args, str(tmp_path))}
    argv = children["decode-0"].argv
    assert argv[-3:-1] == ["decode", "--settings"] and len(argv) == 6  # nothing rebuilt by hand
    assert read_settings(argv[-1], DecodeSettings) == children["decode-0"].settings
    assert read_settings(argv[-1], DecodeSettings).lease_ttl_s == 7.0


def test_a_worker_alone_plans_as_the_only_one_on_its_machine(tmp_path, monkeypatch):
    """The same planner, from `pdserve prefill|decode` flags: CPU prefill budget, idle lanes on
    the cores outside its threads, no lending or pacing for a decode worker alone."""
    monkeypatch.setattr(topology.os, "cpu_count", lambda: 8)
    common = ["--model", str(tmp_path), "--gateway", "ipc:///tmp/g", "--threads", "2"]
    p = prefill_settings(build_parser().parse_args(["prefill", *common]))
    assert isinstance(p, PrefillSettings) and p.idle_lanes == 3 and p.engine.scheduler.max_num_batched_tokens == 512
    d = decode_settings(build_parser().parse_args(["decode", *common]))
    assert d.idle_threads == 2 and d.step_interval_ms == 0.0 and d.engine.scheduler.max_num_batched_tokens == 2048


def test_a_bad_settings_file_fails_at_start_naming_the_field(tmp_path):
    good = PrefillSettings(
        engine=prefill_settings(
            build_parser().parse_args(["prefill", "--model", str(tmp_path), "--gateway", "ipc:///tmp/g"])
        ).engine,
        gateways=["ipc:///tmp/g"],
        host="h",
    )
    raw = msgspec.json.decode(msgspec.json.encode(good))
    for change, words in (
        ({"lanes": 0}, "lanes"),
        ({"gateways": []}, "gateway"),
        ({"lanez": 1}, "lanez"),
        ({"engine": {**raw["engine"], "cache": {"block_size": 3}}}, "block_size"),
    ):
        path = tmp_path / "bad.json"
        path.write_bytes(msgspec.json.encode({**raw, **change}))
        r = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "prefill", "--settings", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "prefill", "--settings", str(path), "--lanes", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "takes no other flags" in r.stderr


def test_tpot_target_must_be_positive(tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        plan(tmp_path, monkeypatch, 2, "--tpot-slo-ms", "0")
