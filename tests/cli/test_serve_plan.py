"""`pdserve serve` splits the machine's cores between the pools it starts."""
from __future__ import annotations

import pytest

from pdserve.cli import serve
from pdserve.cli.main import build_parser


def plan(tmp_path, monkeypatch, cores: int, *flags: str) -> dict[str, list[str]]:
    monkeypatch.setattr(serve.os, "cpu_count", lambda: cores)
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), *flags])
    return {c.name: c.argv for c in serve.plan_children(args, str(tmp_path))}


def flag(argv: list[str], name: str) -> str | None:
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1] if name in argv else None  # the last one wins


@pytest.mark.parametrize("cores,threads,idle", [(2, "1", "2"), (8, "4", "8")])
def test_1p1d_splits_cores_and_decode_borrows_them_when_idle(tmp_path, monkeypatch, cores, threads, idle):
    children = plan(tmp_path, monkeypatch, cores)
    assert flag(children["prefill-0"], "--threads") == threads
    assert flag(children["decode-0"], "--threads") == threads
    assert flag(children["decode-0"], "--idle-threads") == idle


def test_lending_can_be_turned_off_and_is_per_decode_worker(tmp_path, monkeypatch):
    children = plan(tmp_path, monkeypatch, 8, "--decode-idle-threads", "2", "--decode-threads", "2")
    assert flag(children["decode-0"], "--idle-threads") == "2"
    children = plan(tmp_path, monkeypatch, 8, "--decode-workers", "2")
    assert flag(children["decode-1"], "--idle-threads") == "4"  # 8 cores / 2 decode workers


@pytest.mark.parametrize("cores,flags,lanes", [(2, (), "1"), (8, (), "1"), (2, ("--prefill-workers", "2"), "0"),
                                               (2, ("--prefill-idle-lanes", "0"), "0")])
def test_prefill_idle_lanes_cover_the_cores_outside_the_prefill_pool(tmp_path, monkeypatch, cores, flags, lanes):
    children = plan(tmp_path, monkeypatch, cores, *flags)
    assert flag(children["prefill-0"], "--idle-lanes") == lanes


@pytest.mark.parametrize("cores,flags,interval", [
    (2, (), "36.0"),  # 1P1D: the prefill worker's idle lane takes the gaps, 0.6 x the 60 ms TPOT target
    (2, ("--tpot-slo-ms", "30"), "18.0"),  # a tighter target paces closer
    (2, ("--prefill-workers", "2"), "36.0"),  # 2P1D: three threads on two cores
    (2, ("--prefill-idle-lanes", "0"), "0.0"),  # nobody to yield the core to
    (8, ("--decode-workers", "2", "--decode-step-interval-ms", "40"), "40.0")])
def test_decode_steps_are_paced_when_prefill_can_use_their_cores(tmp_path, monkeypatch, cores, flags, interval):
    children = plan(tmp_path, monkeypatch, cores, *flags)
    decoders = [argv for name, argv in children.items() if name.startswith("decode-")]
    assert decoders and all(flag(argv, "--step-interval-ms") == interval for argv in decoders)


def test_tpot_target_must_be_positive(tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        plan(tmp_path, monkeypatch, 2, "--tpot-slo-ms", "0")
