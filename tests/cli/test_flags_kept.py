"""Every flag of `pdserve prefill|decode|colocated|gateway|serve`, as they were before the flags
were generated from the settings structs (cli/settings_flags.py): names, defaults, choices, kind
and metavar. Users' scripts, the README and deploy/ depend on them; a change here is deliberate."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli.main import build_parser

# flag: (default, choices, kind, metavar); kind: "" a value, "append", "store_true", "on/off"
# (--X / --no-X), " required" appended where the flag must be given
ENGINE = {
    "--model": (None, None, "", None),
    "--dtype": ("auto", ("auto", "float32", "bfloat16", "float16"), "", None),
    "--quantization": ("auto", ("auto", "none", "int8", "int4"), "", None),
    "--activation-quantization": ("auto", ("auto", "none", "int8"), "", None),  # added with the int8-activation kernel
    "--prompt-linears": ("auto", ("auto", "int8", "bf16"), "", None),  # added with the bf16 prompt kernel
    "--model-impl": ("auto", ("auto", "native", "transformers"), "", None),
    "--device": ("cpu", None, "", None),
    "--enforce-eager": (False, None, "store_true", None),  # added with CUDA graphs
    "--block-size": (16, None, "", None),
    "--num-blocks": (None, None, "", None),
    "--kv-cache-memory": (1073741824, None, "", None),
    "--enable-prefix-caching": (True, None, "on/off", None),
    "--kv-cache-dtype": ("auto", ("auto", "int8", "fp8"), "", None),  # added with int8 KV blocks (fp8: e4m3 rows)
    "--kv-offload-dir": (None, None, "", None),  # added with the prefix cache's disk tier
    "--kv-offload-size": (20 * 2**30, None, "", None),
    "--max-num-seqs": (64, None, "", None),
    "--max-num-batched-tokens": (None, None, "", None),
    "--max-model-len": (None, None, "", None),
    "--scheduling-policy": ("fcfs", ("fcfs", "shortest-first"), "", None),
    "--tensor-parallel-size": (1, None, "", None),
    "--seed": (None, None, "", None),
    "--speculative-config": (None, None, "", None),
    "--threads": (None, None, "", None),
}
WORKER = {
    **ENGINE,
    "--settings": (None, None, "", "FILE"),
    "--gateway": (None, None, "append required", None),
    "--bind": ("tcp://127.0.0.1:0", None, "", None),
    "--drain-timeout": (30.0, None, "", None),
    "--otlp-traces-endpoint": (None, None, "", "URL"),
    "--health-bind": (None, None, "", "HOST:PORT"),
    "--advertise-host": (None, None, "", None),
}
MAC = {"--kv-payload-mac": ("auto", ("auto", "on", "off"), "", None)}
PREFILL = {
    **WORKER,
    **MAC,
    "--lanes": (1, None, "", None),
    "--idle-lanes": (None, None, "", None),
    "--prefix-export-bind": ("tcp://127.0.0.1:0", None, "", None),  # added with prefix fetches between workers
    "--no-prefix-sharing": (False, None, "store_true", None),
}
DECODE = {
    **WORKER,
    **MAC,
    "--kv-bind": ("tcp://127.0.0.1:0", None, "", None),
    "--no-shm": (False, None, "store_true", None),
    "--lease-ttl": (30.0, None, "", None),
    "--idle-threads": (None, None, "", None),
    "--min-num-seqs": (None, None, "", None),
    "--tpot-slo-ms": (60.0, None, "", None),
    "--step-interval-ms": (None, None, "", None),
    "--kv-advertise": (None, None, "", None),
}
FRONT = {  # the gateway's flags that `serve` passes on to its gateway
    "--host": ("127.0.0.1", None, "", None),
    "--port": (8000, None, "", None),
    "--api-key": (None, None, "", None),
    "--api-keys-file": (None, None, "", "PATH"),
    "--ssl-certfile": (None, None, "", "PEM"),
    "--ssl-keyfile": (None, None, "", "PEM"),
    "--served-model-name": (None, None, "", None),
    "--request-timeout": (None, None, "", None),
    "--max-queued-requests": (1024, None, "", None),
    "--max-queued-tokens": (2097152, None, "", None),
    "--max-queue-wait": (300.0, None, "", None),
    "--stream-write-timeout": (30.0, None, "", None),
    "--chat-template": (None, None, "", None),
    "--tool-call-parser": (None, ("hermes", "llama3_json", "mistral", "pythonic"), "", None),
    "--reasoning-parser": (None, ("qwen3", "deepseek_r1"), "", None),  # added with reasoning output
    "--local-prefill-max-tokens": (128, None, "", None),
    "--prefill-placement": ("auto", ("auto", "remote", "local"), "", None),
    "--router": ("kv-aware", ("kv-aware", "least-loaded", "round-robin"), "", None),
    "--otlp-traces-endpoint": (None, None, "", "URL"),
    "--on-decode-failure": ("migrate", ("migrate", "fail"), "", None),
    "--stuck-after": (30.0, None, "", None),
}
GATEWAY = {
    **FRONT,
    "--settings": (None, None, "", "FILE"),
    "--model": (None, None, "", None),
    "--worker-bind": ("tcp://127.0.0.1:7100", None, "", None),
    "--worker-advertise": (None, None, "", None),
    "--allow-wildcard-bind": (False, None, "store_true", None),
    "--kv-transport": ("auto", ("auto", "shm", "cuda-ipc", "zmq"), "", None),  # cuda-ipc added
    "--max-model-len": (None, None, "", None),
}
SERVE = {
    **ENGINE,
    **FRONT,
    **MAC,
    "--prefill-workers": (1, None, "", None),
    "--decode-workers": (1, None, "", None),
    "--colocated": (False, None, "store_true", None),
    "--prefill-threads": (None, None, "", None),
    "--decode-threads": (None, None, "", None),
    "--prefill-tensor-parallel-size": (None, None, "", None),
    "--decode-tensor-parallel-size": (None, None, "", None),
    "--decode-idle-threads": (None, None, "", None),
    "--kv-transport": ("auto", ("auto", "shm", "cuda-ipc", "zmq-ipc", "zmq-tcp"), "", None),  # cuda-ipc added
    "--lease-ttl": (30.0, None, "", None),
    "--prefill-nice": (0, None, "", None),
    "--prefill-idle-lanes": (None, None, "", None),
    "--tpot-slo-ms": (60.0, None, "", None),
    "--min-num-seqs": (None, None, "", None),
    "--decode-step-interval-ms": (None, None, "", None),
    "--prefill-max-num-batched-tokens": (None, None, "", None),
    "--no-prefix-sharing": (False, None, "store_true", None),  # added with prefix fetches between workers
}
GOLDEN = {"prefill": PREFILL, "decode": DECODE, "colocated": WORKER, "gateway": GATEWAY, "serve": SERVE}
KINDS = {
    argparse._StoreAction: "",
    argparse._AppendAction: "append",
    argparse._StoreTrueAction: "store_true",
    argparse.BooleanOptionalAction: "on/off",
}


def flags_of(command: str) -> dict[str, tuple]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for a in sub.choices[command]._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        kind = KINDS[type(a)] + (" required" if a.required else "")
        out[a.option_strings[0]] = (a.default, tuple(a.choices) if a.choices else None, kind, a.metavar)
    return out


@pytest.mark.parametrize("command", list(GOLDEN))
def test_every_flag_keeps_its_name_default_choices_and_kind(command):
    got, want = flags_of(command), GOLDEN[command]
    assert sorted(got) == sorted(want), f"added {sorted(set(got) - set(want))}, lost {sorted(set(want) - set(got))}"
    assert {f: v for f, v in got.items() if v != want[f]} == {}, "changed (got)"


def test_flags_that_convert_their_text_still_do():
    parse = build_parser().parse_args
    common = ["--gateway", "ipc:///tmp/g"]
    assert parse(["prefill", *common, "--kv-cache-memory", "512MiB"]).kv_cache_memory == 512 * 2**20
    assert parse(["prefill", *common, "--kv-cache-memory", "2G"]).kv_cache_memory == 2 * 2**30
    assert parse(["decode", *common, "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(["decode", *common, "--gateway", "ipc:///tmp/h"]).gateway == ["ipc:///tmp/g", "ipc:///tmp/h"]
    assert parse(["serve", "--max-queue-wait", "2.5"]).max_queue_wait == 2.5
    for argv in (
        ["serve", "--max-queue-wait", "0"],
        ["serve", "--stream-write-timeout", "-1"],
        ["decode", *common, "--tpot-slo-ms", "0"],
        ["prefill", *common, "--dtype", "float64"],
        ["prefill", *common, "--block-size", "x"],
        ["gateway", "--router", "random"],
        ["decode"],  # --gateway is required
    ):
        with pytest.raises(SystemExit):
            parse(argv)


@pytest.mark.parametrize("command", list(GOLDEN))
def test_every_flag_that_had_help_has_it(command):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = {a.option_strings[0] for a in sub.choices[command]._actions if not a.help}
    assert bare <= UNDOCUMENTED, sorted(bare - UNDOCUMENTED)


# flags that had no help text before (they may gain one)
UNDOCUMENTED = {
    "--dtype",
    "--device",
    "--block-size",
    "--max-num-seqs",
    "--max-model-len",
    "--seed",
    "--host",
    "--port",
    "--kv-transport",
    "--api-key",
    "--served-model-name",
    "--on-decode-failure",
    "--prefill-workers",
    "--decode-workers",
}
