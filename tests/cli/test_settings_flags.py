"""Flags made from settings structs (cli/settings_flags.py): the rules on a small struct, and
every flag of every role reaching its field in the settings the role starts from."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import pytest

from pdserve.cli import roles, serve, topology
from pdserve.cli.main import build_parser
from pdserve.cli.serve_settings import DECODE_FLAGS, GATEWAY_FIELDS_SET
from pdserve.cli.settings_flags import add_flags, flag_fields, from_flags
from pdserve.flag import Flag, parse_size
from pdserve.gateway.options import GatewayOptions


@dataclass(frozen=True)
class Inner:
    size: Annotated[int, Flag("a size", name="--mem", parse=parse_size)] = 1024
    unflagged: float = 0.5


class Outer(msgspec.Struct, frozen=True, kw_only=True):
    peers: Annotated[list[str], Flag("peers", name="--peer")]
    mode: Annotated[Literal["a", "b"], Flag("mode")] = "a"
    count: Annotated[int, Flag("count", planned=True)] = 3
    ratio: Annotated[float | None, Flag("ratio", metavar="R")] = None
    fast: Annotated[bool, Flag("fast")] = False
    cache: Annotated[bool, Flag("cache")] = True
    shared: Annotated[bool, Flag("plain memory", name="--no-shared")] = True
    inner: Inner = msgspec.field(default_factory=Inner)
    internal: str = "x"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_flags(p, Outer)
    return p


def test_a_struct_s_fields_make_its_flags():
    p = parser()
    by_option = {a.option_strings[0]: a for a in p._actions}
    assert set(by_option) == {
        "-h",
        "--peer",
        "--mode",
        "--count",
        "--ratio",
        "--fast",
        "--cache",
        "--no-shared",
        "--mem",
    }
    assert by_option["--mode"].choices == ("a", "b") and by_option["--mode"].default == "a"
    assert by_option["--count"].default is None  # planned: the caller fills it in
    assert by_option["--ratio"].metavar == "R" and by_option["--ratio"].type is float
    assert by_option["--peer"].required and by_option["--cache"].option_strings == ["--cache", "--no-cache"]
    assert any(g.title == "inner" for g in p._action_groups)  # a nested struct: a group of its own


def test_parsed_flags_make_the_struct_back():
    args = parser().parse_args(["--peer", "p1", "--peer", "p2", "--mode", "b", "--fast", "--no-cache", "--no-shared"])
    got = from_flags(Outer, args)
    assert got == Outer(peers=["p1", "p2"], mode="b", fast=True, cache=False, shared=False)
    args = parser().parse_args(["--peer", "p", "--count", "7", "--ratio", "0.25", "--mem", "2KiB"])
    assert from_flags(Outer, args) == Outer(peers=["p"], count=7, ratio=0.25, inner=Inner(size=2048))
    # given values win, a dotted path reaches into a nested struct; a planned flag left out: the default
    got = from_flags(Outer, parser().parse_args(["--peer", "p"]), {"peers": ["q"], "inner.unflagged": 2.0})
    assert got == Outer(peers=["q"], inner=Inner(unflagged=2.0)) and got.count == 3


def test_bad_flag_text_is_a_usage_error(capsys):
    for argv in (["--peer", "p", "--mem", "lots"], ["--peer", "p", "--mode", "c"], ["--mode", "a"]):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
    assert "--mem" in capsys.readouterr().err


# flag -> (its command-line words, the value its field should get); every generated flag needs one
SAMPLES: dict[str, tuple[list[str], object]] = {
    "--dtype": (["float32"], "float32"),
    "--quantization": (["int8"], "int8"),
    "--activation-quantization": (["int8"], "int8"),
    "--prompt-linears": (["bf16"], "bf16"),
    "--model-impl": (["native"], "native"),
    "--device": (["cuda:1"], "cuda:1"),
    "--enforce-eager": (["--enforce-eager"], True),
    "--block-size": (["32"], 32),
    "--num-blocks": (["100"], 100),
    "--kv-cache-memory": (["2MiB"], 2 * 2**20),
    "--enable-prefix-caching": (["--no-enable-prefix-caching"], False),
    "--kv-cache-dtype": (["int8"], "int8"),
    "--kv-offload-dir": (["/var/cache/pdserve-kv"], "/var/cache/pdserve-kv"),
    "--kv-offload-size": (["3GiB"], 3 * 2**30),
    "--max-num-seqs": (["8"], 8),
    "--max-num-batched-tokens": (["100"], 100),
    "--max-model-len": (["300"], 300),
    "--scheduling-policy": (["shortest-first"], "shortest-first"),
    "--seed": (["5"], 5),
    "--threads": (["3"], 3),
    "--gateway": (["ipc:///tmp/g"], ["ipc:///tmp/g"]),
    "--bind": (["ipc:///tmp/b"], "ipc:///tmp/b"),
    "--drain-timeout": (["4.5"], 4.5),
    "--otlp-traces-endpoint": (["http://c:4318"], "http://c:4318"),
    "--health-bind": (["127.0.0.1:9"], "127.0.0.1:9"),
    "--advertise-host": (["h1"], "h1"),
    "--kv-payload-mac": (["on"], "on"),
    "--lanes": (["2"], 2),
    "--idle-lanes": (["3"], 3),
    "--prefix-export-bind": (["ipc:///tmp/e"], "ipc:///tmp/e"),
    "--no-prefix-sharing": (["--no-prefix-sharing"], False),
    "--kv-bind": (["tcp://127.0.0.1:5"], "tcp://127.0.0.1:5"),
    "--kv-advertise": (["tcp://a:5"], "tcp://a:5"),
    "--no-shm": (["--no-shm"], False),
    "--lease-ttl": (["7.5"], 7.5),
    "--idle-threads": (["3"], 3),
    "--min-num-seqs": (["2"], 2),
    "--tpot-slo-ms": (["45"], 45.0),
    "--step-interval-ms": (["12"], 12.0),
    "--host": (["0.0.0.0"], "0.0.0.0"),
    "--port": (["9001"], 9001),
    "--worker-bind": (["tcp://127.0.0.1:7200"], "tcp://127.0.0.1:7200"),
    "--worker-advertise": (["tcp://gw:7200"], "tcp://gw:7200"),
    "--allow-wildcard-bind": (["--allow-wildcard-bind"], True),
    "--kv-transport": (["zmq"], "zmq"),
    "--api-key": (["k"], "k"),
    "--api-keys-file": (["keys.json"], os.path.abspath("keys.json")),
    "--ssl-certfile": (["c.pem"], os.path.abspath("c.pem")),
    "--ssl-keyfile": (["k.pem"], os.path.abspath("k.pem")),
    "--served-model-name": (["m"], "m"),
    "--on-decode-failure": (["fail"], "fail"),
    "--request-timeout": (["9.5"], 9.5),
    "--stream-write-timeout": (["3.5"], 3.5),
    "--chat-template": (["t.jinja"], "t.jinja"),
    "--tool-call-parser": (["hermes"], "hermes"),
    "--reasoning-parser": (["qwen3"], "qwen3"),
    "--max-queued-requests": (["5"], 5),
    "--max-queued-tokens": (["99"], 99),
    "--max-queue-wait": (["2.5"], 2.5),
    "--stuck-after": (["4.5"], 4.5),
    "--local-prefill-max-tokens": (["9"], 9),
    "--router": (["round-robin"], "round-robin"),
    "--prefill-placement": (["auto"], "auto"),
}
# covered where they need a real model: tests/engine/test_tensor_parallel.py, tests/cli/test_speculative_flag.py
ELSEWHERE = {"--model", "--tensor-parallel-size", "--speculative-config"}


def field_at(settings: object, path: str) -> object:
    for name in path.split("."):
        settings = getattr(settings, name)
    return settings


def sampled(fields) -> list[str]:
    argv = []
    for _, f in fields:
        if f.option not in ELSEWHERE:
            assert f.option in SAMPLES, f"a sample value for {f.option}"
            argv += (
                SAMPLES[f.option][0] if SAMPLES[f.option][0][0].startswith("--") else [f.option, *SAMPLES[f.option][0]]
            )
    return argv


def check(settings: object, fields) -> None:
    wrong = {
        path: field_at(settings, path)
        for path, f in fields
        if f.option not in ELSEWHERE and field_at(settings, path) != SAMPLES[f.option][1]
    }
    assert wrong == {}


def options(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.option_strings[0] for a in sub.choices[command]._actions} - {"-h", "--settings"}


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_every_worker_flag_reaches_its_settings_field(role, tmp_path):
    fields = list(flag_fields(roles.settings_type(role)))
    assert options(role) == {f.option for _, f in fields}  # no flag outside the struct
    args = build_parser().parse_args([role, "--model", str(tmp_path), *sampled(fields)])
    check(getattr(roles, f"{role}_settings")(args), fields)


def test_every_gateway_flag_reaches_its_option(tmp_path):
    fields = list(flag_fields(GatewayOptions))
    assert options("gateway") == {f.option for _, f in fields}
    args = build_parser().parse_args(["gateway", "--model", str(tmp_path), *sampled(fields)])
    check(roles.gateway_options(args), fields)


def test_serve_passes_its_children_s_flags_on(tmp_path, monkeypatch):
    """The gateway's and decode workers' flags `serve` takes land in those children's settings files."""
    monkeypatch.setattr(topology.os, "cpu_count", lambda: 2)
    gateway = [(p, f) for p, f in flag_fields(GatewayOptions) if p not in GATEWAY_FIELDS_SET and p != "api_key"]
    decode = [(p, f) for p, f in flag_fields(roles.settings_type("decode")) if p in DECODE_FLAGS]
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), *sampled(gateway), *sampled(decode)])
    children = {c.name: c for c in serve.plan_children(args, str(tmp_path))}
    read = {
        name: msgspec.json.decode(open(c.argv[-1], "rb").read(), type=type(c.settings)) for name, c in children.items()
    }
    check(read["gateway"], gateway)
    check(read["decode-0"], decode)
    assert read["gateway"].api_key is None  # the key travels in the environment, not in a file


def test_a_given_path_that_is_no_field_is_refused():
    args = parser().parse_args(["--peer", "p"])
    for given in ({"inner.nope": 1}, {"mode.x": 1}, {"nope": 1}):
        with pytest.raises(TypeError, match="no fields"):
            from_flags(Outer, args, given)
