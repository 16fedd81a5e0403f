"""The rates the placement cost model (gateway/prefill_placement.py) reads, measured from what the
gateway already sees of each request's first output:

- prefill pool tokens/s: a prefill worker's first output carries `prefill_compute_s`; its
  tokens are the prompt less `cached_tokens`. Prompts batched or chunked together finish close
  together, so a sample's seconds are capped at the time since that worker's previous first
  output: a busy worker's samples add up to its busy time, not to one prompt's time per prompt.
- decode worker's own prefill tokens/s: from its "local" ReserveReply to its first output (the
  wait for its running step included: that is what a local prompt pays), capped the same way.
- KV link bytes/s: `kv_bytes` / `kv_transfer_s` of the prefill worker's timings.
- prefix fetch bytes/s (gateway/prefix_fetch_plan.py): `prefix_fetch_bytes` / `prefix_fetch_s` of
  a prefill worker's timings when it fetched a prompt's blocks from a peer (the whole fetch: the
  connection, the peer's copy-out, the transfer and the load into its pool).
Each rate is an EWMA of amount and of seconds apart (rate = their ratio, so a sample with little
time weighs by its amount, not as a spike). Until measured: DEFAULT_PREFILL_TOKENS_PER_S and
DEFAULT_LINK_BYTES_PER_S, and a decode worker's own rate is taken as the prefill pool's (the same
model on the same kind of device) until it has prefilled something itself, and again when its
latest sample is older than LOCAL_RATE_TTL_S: a decode worker measured slow once (a busy moment)
would otherwise never be tried again, since only local prefills measure it. One set per gateway
(pool-wide: the workers of a pool are alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
DEFAULT_LINK_BYTES_PER_S = 1e9  # loopback TCP is about this; shared memory faster
EWMA_ALPHA = 0.2  # weight of the newest sample
LOCAL_RATE_TTL_S = 20.0  # a decode worker's own rate older than this: the prefill pool's again

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of every layer for one token (a worker's KvLayout)."""
    return 2 * num_layers * num_kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


@dataclass
class RateMeter:
    """amount/s as the ratio of two EWMAs; `default` until the first sample."""

    default: float
    amount: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    last_sample_at: float = 0.0  # monotonic

    def observe(self, amount: float, seconds: float, now: float = 0.0) -> None:
        if amount <= 0 or seconds < 0:
            return
        self.last_sample_at = now
        if self.samples == 0:
            self.amount, self.seconds = amount, seconds
        else:
            self.amount += EWMA_ALPHA * (amount - self.amount)
            self.seconds += EWMA_ALPHA * (seconds - self.seconds)
        self.samples += 1

    @property
    def rate(self) -> float:
        if self.samples == 0 or self.seconds <= 0:
            return self.default
        return self.amount / self.seconds


@dataclass
class PlacementRates:
    prefill: RateMeter = field(default_factory=lambda: RateMeter(DEFAULT_PREFILL_TOKENS_PER_S))
    local: RateMeter = field(default_factory=lambda: RateMeter(DEFAULT_PREFILL_TOKENS_PER_S))
    link: RateMeter = field(default_factory=lambda: RateMeter(DEFAULT_LINK_BYTES_PER_S))
    fetch: RateMeter = field(default_factory=lambda: RateMeter(DEFAULT_LINK_BYTES_PER_S))
    _last_first_output: dict[str, float] = field(default_factory=dict)  # worker id -> monotonic

    def _busy_seconds(self, worker_id: str, seconds: float, now: float) -> float:
        last = self._last_first_output.get(worker_id)
        self._last_first_output[worker_id] = now
        return seconds if last is None else min(seconds, now - last)

    def observe_remote(self, worker_id: str, tokens: int, timings: dict[str, float], now: float) -> None:
        """A prefill worker's first output: `tokens` computed in timings["prefill_compute_s"]."""
        if "prefill_compute_s" in timings:
            self.prefill.observe(tokens, self._busy_seconds(worker_id, timings["prefill_compute_s"], now))
        if timings.get("kv_transfer_s", 0.0) > 0:
            self.link.observe(timings.get("kv_bytes", 0.0), timings["kv_transfer_s"])
        if timings.get("prefix_fetch_s", 0.0) > 0:
            self.fetch.observe(timings.get("prefix_fetch_bytes", 0.0), timings["prefix_fetch_s"])

    def observe_local(self, worker_id: str, tokens: int, started: float, now: float) -> None:
        """A decode worker's first output of a prompt it took at `started` (monotonic)."""
        self.local.observe(tokens, self._busy_seconds(worker_id, now - started, now), now)

    def local_rate(self, now: float) -> float:
        fresh = self.local.samples and now - self.local.last_sample_at <= LOCAL_RATE_TTL_S
        return self.local.rate if fresh else self.prefill.rate
