"""Peak KV use read from a server's /metrics: pdserve's block gauges and vLLM's usage gauge."""

from __future__ import annotations

from pdserve.bench.kv_usage import kv_usage

PDSERVE = """\
pdserve_kv_blocks_free{node="prefill-1-2"} 10.0
pdserve_kv_blocks_total{node="prefill-1-2"} 100.0
pdserve_kv_blocks_free{node="decode-3-4"} 150.0
pdserve_kv_blocks_total{node="decode-3-4"} 200.0
pdserve_kv_blocks_free{node="decode-5-6"} 200.0
pdserve_kv_blocks_total{node="decode-5-6"} 200.0
"""


def test_pdserve_counts_its_decode_workers_only():
    assert kv_usage(PDSERVE) == (50 / 400, 50)  # the prefill worker's 90 used blocks are not sequences'


def test_vllm_usage_gauge():
    text = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.375\nvllm:num_requests_running{} 2.0\n'
    assert kv_usage(text) == (0.375, None)


def test_unknown_server_reports_nothing():
    assert kv_usage("# HELP something\nother_metric 1.0\n") is None
