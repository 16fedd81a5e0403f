"""The AIMD benchmark reads the decode worker's limit, running sequences and preemptions from
the names the gateway's /metrics really exports (a counter's samples end in `_total`)."""

from pdserve.bench.aimd import PREEMPTIONS, _decode_gauge
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.protocol.messages import WorkerStats


def test_reads_what_the_gateway_exports():
    stats = {
        "decode-a": WorkerStats(preemptions=3, seq_limit=12, num_running=5),
        "decode-b": WorkerStats(preemptions=2, seq_limit=4, num_running=1),
        "prefill-a": WorkerStats(preemptions=7),  # not a decode worker: not counted
    }
    text = GatewayMetrics(lambda: stats, dict).render().decode()
    assert _decode_gauge(text, PREEMPTIONS) == 5
    assert _decode_gauge(text, "pdserve_max_num_seqs") == 16
    assert _decode_gauge(text, "pdserve_num_requests_running") == 6
