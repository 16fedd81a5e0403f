"""`--speculative-config` reaches the decode and colocated children's settings files, and the
prefill pool's when it names a draft model (the prefill worker builds and ships the draft's KV;
n-gram needs nothing there), and a bad one is refused naming the problem."""

from __future__ import annotations

import pytest

from pdserve.cli import serve
from pdserve.cli.main import build_parser
from pdserve.cli.roles import colocated_settings, decode_settings, prefill_settings
from pdserve.decode_node.settings import ColocatedSettings, DecodeSettings
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.prefill_node.settings import PrefillSettings
from pdserve.runtime.worker_settings import read_settings

FLAG = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']
WANT = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)


def test_serve_hands_ngram_to_decode_workers_only(tmp_path):
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), *FLAG])
    children = {c.name: c for c in serve.plan_children(args, str(tmp_path))}
    decode = read_settings(children["decode-0"].argv[-1], DecodeSettings)
    assert decode.engine.speculative == WANT
    assert read_settings(children["prefill-0"].argv[-1], PrefillSettings).engine.speculative is None  # n-gram
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--colocated", *FLAG])
    colocated = next(c for c in serve.plan_children(args, str(tmp_path)) if c.name.startswith("colocated"))
    assert read_settings(colocated.argv[-1], ColocatedSettings).engine.speculative == WANT


def test_workers_started_alone_take_it(tmp_path):
    common = ["--model", str(tmp_path), "--gateway", "ipc:///tmp/g", *FLAG]
    assert decode_settings(build_parser().parse_args(["decode", *common])).engine.speculative == WANT
    assert colocated_settings(build_parser().parse_args(["colocated", *common])).engine.speculative == WANT
    assert decode_settings(build_parser().parse_args(["decode", *common[:4]])).engine.speculative is None


def test_a_bad_config_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--model", str(tmp_path), "--speculative-config", '{"k": 2}'])
    assert "unknown keys ['k']" in capsys.readouterr().err


def test_a_draft_model_reaches_decode_and_prefill_workers(tiny_llama):
    flag = ["--speculative-config", f'{{"model": "{tiny_llama}", "num_speculative_tokens": 3}}']
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama), *flag])
    children = {c.name: c for c in serve.plan_children(args, str(tiny_llama))}
    want = SpeculativeConfig(method="draft_model", model=str(tiny_llama), num_speculative_tokens=3)
    assert read_settings(children["decode-0"].argv[-1], DecodeSettings).engine.speculative == want
    assert read_settings(children["prefill-0"].argv[-1], PrefillSettings).engine.speculative == want
    common = ["--model", str(tiny_llama), "--gateway", "ipc:///tmp/g", *flag]
    assert prefill_settings(build_parser().parse_args(["prefill", *common])).engine.speculative == want
    common = ["--model", str(tiny_llama), "--gateway", "ipc:///tmp/g", *flag]
    assert prefill_settings(build_parser().parse_args(["prefill", *common])).engine.speculative == want
