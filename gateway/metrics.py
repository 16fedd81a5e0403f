"""Prometheus metrics, one registry per app (two gateways in one process never collide)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.gateway.queue_stats import QueueStats
from pdserve.protocol.messages import WorkerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1)


class _WorkerCollector:
    """Per-worker gauges read from the backend at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, WorkerStats]], routed: Callable[[], dict[str, int]]) -> None:
        self._stats, self._routed = stats, routed

    def collect(self):
        fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "kv_blocks_free": GaugeMetricFamily("pdserve_kv_blocks_free", "Free KV blocks", labels=["node"]),
            "kv_blocks_total": GaugeMetricFamily("pdserve_kv_blocks_total", "KV blocks", labels=["node"]),
            "num_running": GaugeMetricFamily("pdserve_num_requests_running", "Running sequences", labels=["node"]),
            "num_waiting": GaugeMetricFamily("pdserve_num_requests_waiting", "Queued requests", labels=["node"]),
            "dropped_frames": GaugeMetricFamily(
                "pdserve_dropped_frames", "Bad internal frames dropped", labels=["node"]
            ),
            "leases_active": GaugeMetricFamily("pdserve_kv_leases_active", "Reservations awaiting KV", labels=["node"]),
            "kv_blocks_quarantined": GaugeMetricFamily(
                "pdserve_kv_blocks_quarantined", "Blocks of ended leases held until their deadline", labels=["node"]
            ),
            "lease_renewals": GaugeMetricFamily(
                "pdserve_kv_lease_renewals",
                "Leases extended for prefill workers still holding them (total)",
                labels=["node"],
            ),
            "kv_blocks_cached": GaugeMetricFamily(
                "pdserve_kv_blocks_cached",
                "Free KV blocks whose KV the prefix cache keeps (reclaimable)",
                labels=["node"],
            ),
            "preemptions": CounterMetricFamily(
                "pdserve_preemptions", "Sequences preempted (KV dropped, recomputed later)", labels=["node"]
            ),
            "seq_limit": GaugeMetricFamily(
                "pdserve_max_num_seqs",
                "The worker's limit on running sequences now (adaptive with --min-num-seqs)",
                labels=["node"],
            ),
            "prefix_query_tokens": CounterMetricFamily(
                "pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=["node"]
            ),
            "kv_blocks_skipped": CounterMetricFamily(
                "pdserve_kv_transfer_blocks_skipped",
                "Prompt blocks a decode worker held already at reservation: not transferred",
                labels=["node"],
            ),
            "local_prefills": CounterMetricFamily(
                "pdserve_local_prefills",
                "Requests a decode worker took whole, prefilling their short uncached rest itself",
                labels=["node"],
            ),
            "prefix_hit_tokens": CounterMetricFamily(
                "pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)", labels=["node"]
            ),
            # the prefix cache's disk tier (--kv-offload-dir)
            "kv_disk_blocks": GaugeMetricFamily(
                "pdserve_kv_disk_blocks", "KV blocks in the prefix cache's disk tier", labels=["node"]
            ),
            "kv_disk_bytes": GaugeMetricFamily(
                "pdserve_kv_disk_bytes", "Bytes the prefix cache's disk tier holds", labels=["node"]
            ),
            "kv_disk_hit_tokens": CounterMetricFamily(
                "pdserve_kv_disk_hits",
                "Prompt tokens read back from the disk tier instead of computed",
                labels=["node"],
            ),
            "kv_disk_write_bytes": CounterMetricFamily(
                "pdserve_kv_disk_written_bytes", "Bytes written to the disk tier", labels=["node"]
            ),
            "kv_disk_read_bytes": CounterMetricFamily(
                "pdserve_kv_disk_read_bytes", "Bytes read back from the disk tier", labels=["node"]
            ),
            "kv_disk_evictions": CounterMetricFamily(
                "pdserve_kv_disk_evictions", "Disk tier files removed to stay within its size", labels=["node"]
            ),
            "kv_disk_corrupt": CounterMetricFamily(
                "pdserve_kv_disk_corrupt",
                "Disk tier files that failed their checksum or were cut short (deleted; recomputed)",
                labels=["node"],
            ),
            # prefix blocks fetched from peer workers instead of computed (prefill_node/prefix_sharing.py)
            "prefix_fetches": CounterMetricFamily(
                "pdserve_prefix_fetches", "Fetches of a prompt's leading blocks asked of a peer worker", labels=["node"]
            ),
            "prefix_fetch_blocks": CounterMetricFamily(
                "pdserve_prefix_fetch_blocks",
                "KV blocks fetched from peer workers into the prefix cache (not computed)",
                labels=["node"],
            ),
            "prefix_fetch_bytes": CounterMetricFamily(
                "pdserve_prefix_fetch_bytes", "KV bytes fetched from peer workers", labels=["node"]
            ),
            "prefix_fetch_failures": CounterMetricFamily(
                "pdserve_prefix_fetch_failures",
                "Prefix fetches that brought nothing (peer gone, timed out, refused, bad frames): computed instead",
                labels=["node"],
            ),
            "prefix_exports": CounterMetricFamily(
                "pdserve_prefix_exports", "Peers' prefix fetches this worker answered with blocks", labels=["node"]
            ),
            "prefix_export_blocks": CounterMetricFamily(
                "pdserve_prefix_export_blocks", "KV blocks this worker sent peers", labels=["node"]
            ),
            "prefix_export_bytes": CounterMetricFamily(
                "pdserve_prefix_export_bytes", "KV bytes this worker sent peers", labels=["node"]
            ),
            # constrained decoding (engine/structured/): the workers' masking cost
            "structured_mask_rows": CounterMetricFamily(
                "pdserve_structured_mask_rows", "Logit rows masked by their grammar", labels=["node"]
            ),
            "structured_mask_seconds": CounterMetricFamily(
                "pdserve_structured_mask_seconds",
                "Seconds spent filling and applying grammar masks (divide by rows: the cost of one)",
                labels=["node"],
            ),
            # speculative decoding (engine/spec/), vLLM's counter names
            "spec_num_drafts": CounterMetricFamily(
                "pdserve_spec_decode_num_drafts", "Verification steps of speculating sequences", labels=["node"]
            ),
            "spec_num_draft_tokens": CounterMetricFamily(
                "pdserve_spec_decode_num_draft_tokens", "Draft tokens proposed", labels=["node"]
            ),
            "spec_num_accepted_tokens": CounterMetricFamily(
                "pdserve_spec_decode_num_accepted_tokens", "Draft tokens the target accepted", labels=["node"]
            ),
        }
        per_pos = CounterMetricFamily(
            "pdserve_spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted at each position of a speculation (0: the first draft)",
            labels=["node", "position"],
        )
        draft_kv = CounterMetricFamily(
            "pdserve_spec_draft_prefill_tokens",
            "Prompt tokens of speculating sequences whose draft-model KV a decode worker got shipped "
            "by the prefill worker, found cached in its blocks, or rebuilt by running the draft",
            labels=["node", "source"],
        )
        for node, st in self._stats().items():
            for attr, fam in fams.items():
                fam.add_metric([node], getattr(st, attr))
            for pos, count in enumerate(st.spec_accepted_per_pos):
                per_pos.add_metric([node, str(pos)], count)
            for source in ("shipped", "cached", "rebuilt"):
                draft_kv.add_metric([node, source], getattr(st, f"spec_draft_kv_{source}_tokens"))
        routed = GaugeMetricFamily(
            "pdserve_worker_requests_routed",
            "Requests this gateway has routed to the worker and not seen end",
            labels=["node"],
        )
        for node, count in self._routed().items():
            routed.add_metric([node], count)
        yield from fams.values()
        yield per_pos
        yield draft_kv
        yield routed


class _QueueCollector:
    """Per-pool queue gauges read from the backend at scrape time: `disaggregated` and
    `colocated` are the gateway's admission queues (waiting for a prefill worker's room and a
    decode lease, or a colocated seat), `prefill` the requests handed to prefill workers that
    have not sent their first token (queued there or computing)."""

    def __init__(self, stats: Callable[[], dict[str, QueueStats]]) -> None:
        self._stats = stats

    def collect(self):
        depth = GaugeMetricFamily("pdserve_queue_depth", "Requests waiting per pool", labels=["pool"])
        tokens = GaugeMetricFamily("pdserve_queue_tokens", "Prompt tokens waiting per pool", labels=["pool"])
        for pool, st in self._stats().items():
            depth.add_metric([pool], st.depth)
            tokens.add_metric([pool], st.tokens)
        yield depth
        yield tokens


class GatewayMetrics:
    def __init__(
        self,
        worker_stats: Callable[[], dict[str, WorkerStats]],
        routed_requests: Callable[[], dict[str, int]],
        queue_stats: Callable[[], dict[str, QueueStats]] = dict,
        collectors: tuple = (),
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.ttft_stage = Histogram(
            "pdserve_ttft_breakdown_seconds", "TTFT by stage", ["stage"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved prefill -> decode", registry=r)
        self.finished = Counter("pdserve_requests", "Finished requests (per choice)", ["finish_reason"], registry=r)
        self.http_errors = Counter("pdserve_http_errors", "Error responses", ["status"], registry=r)
        self.in_flight = Gauge("pdserve_gateway_requests_in_flight", "HTTP requests in flight", registry=r)
        self.streams_cut = Counter(
            "pdserve_streams_cut", "Streams ended because the client read too slowly", ["reason"], registry=r
        )
        self.header_deadlines = Counter(
            "pdserve_header_deadlines",
            "Request-header deadlines reached: answered_408, closed_idle (no byte sent), "
            "moved_bytes_unread (the client's bytes were waiting on this server's loop)",
            ["outcome"],
            registry=r,
        )
        # per API key, labelled by the key's name (gateway/tenants.py), never by the key
        self.key_requests = Counter(
            "pdserve_key_requests", "Requests admitted and ended, per API key", ["key"], registry=r
        )
        self.key_prompt_tokens = Counter(
            "pdserve_key_prompt_tokens", "Prompt tokens of ended requests, per API key", ["key"], registry=r
        )
        self.key_completion_tokens = Counter(
            "pdserve_key_completion_tokens", "Tokens generated for ended requests, per API key", ["key"], registry=r
        )
        self.rate_limited = Counter(
            "pdserve_key_rate_limited",
            "Requests refused with 429 for an API key's limit (requests, tokens or concurrency)",
            ["key", "limit"],
            registry=r,
        )
        self.structured_requests = Counter(
            "pdserve_structured_requests",
            "Requests admitted with an output constraint, by kind (json_schema, regex, ..., tool_call)",
            ["kind"],
            registry=r,
        )
        self.structured_compile = Histogram(
            "pdserve_structured_compile_seconds",
            "Gateway time compiling a request's constraint (and tool schemas) to check it",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=r,
        )
        r.register(_WorkerCollector(worker_stats, routed_requests))
        r.register(_QueueCollector(queue_stats))
        for collector in collectors:  # the backend's own (e.g. queue wait histograms)
            r.register(collector)

    def observe_timings(self, timings: dict[str, float]) -> None:
        for key, value in timings.items():
            if key == "kv_bytes":
                self.kv_bytes.inc(value)
            elif key.endswith("_s"):
                self.ttft_stage.labels(stage=key.removesuffix("_s")).observe(value)

    def observe_usage(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.key_requests.labels(key=key).inc()
        self.key_prompt_tokens.labels(key=key).inc(prompt_tokens)
        self.key_completion_tokens.labels(key=key).inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
