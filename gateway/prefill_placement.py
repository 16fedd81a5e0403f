"""Where a prompt is prefilled (conditional disaggregation): on its decode worker, or through the
prefill pool. A pure cost model: the numbers of one decision in, "local" or "remote" out.

    remote_s = (pool_queued_tokens + remote_tokens) / prefill_rate      wait + compute at P
             + transfer_tokens * kv_bytes_per_token / link_rate        its KV crossing to D
    local_s  = local_tokens / local_rate                               compute on D
    local_cost = local_s * (1 + STALL_WEIGHT * decode_running)          + the stall it imposes

A local prefill runs inside the decode worker's step: each of its running sequences waits for
it (one inter-token gap longer by `local_s`), so the cost counts that wait once per running
sequence, weighted by STALL_WEIGHT (1.0: a second of a running stream's delay is worth a second
of this prompt's TTFT: the sum of every request's added latency). Remote costs this prompt the
pool's queue and the KV transfer but stalls nobody. Local when
  - the decode worker has no other prompt waiting (two local prefills would stall its batch
    twice; `waiting` counts heartbeats' queued prompts and this gateway's local prefills there
    without a first token), and
  - `local_tokens <= max_local_tokens` (the hard cap, `--local-prefill-max-tokens`), and
  - local_cost < remote_s (ties go remote).
The transfer streams layer by layer behind P's compute, so counting it whole is conservative:
it delays the request's second token, not its first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PrefillPlacement = Literal["auto", "remote", "local"]
DEFAULT_PREFILL_PLACEMENT: PrefillPlacement = "auto"  # the one default: GatewayOptions, ClusterBackend, Router
PREFILL_PLACEMENTS: tuple[PrefillPlacement, ...] = ("auto", "remote", "local")

STALL_WEIGHT = 1.0  # seconds of cost per second a running sequence waits for a local prefill


@dataclass(frozen=True)
class PlacementInputs:
    """One decision's numbers (tokens, seconds, bytes), as the gateway knows them now."""

    local_tokens: int  # prompt tokens the decode worker would compute (its cache holds the rest)
    remote_tokens: int  # prompt tokens the prefill worker would compute
    transfer_tokens: int  # prompt tokens whose KV would cross to the decode worker
    decode_running: int  # sequences decoding on the decode worker
    decode_waiting: int  # prompts waiting there for its engine
    pool_queued_tokens: int  # prompt tokens queued at the prefill worker ahead of this one
    prefill_rate: float  # prefill worker, prompt tokens/s
    local_rate: float  # decode worker's own prefill, prompt tokens/s
    link_rate: float  # KV link, bytes/s
    kv_bytes_per_token: int  # K and V of every layer for one token

    def __post_init__(self) -> None:
        if min(self.prefill_rate, self.local_rate, self.link_rate) <= 0:
            raise ValueError(f"rates must be positive: {self}")


@dataclass(frozen=True)
class PlacementCosts:
    local_s: float  # the prompt's compute on the decode worker
    local_cost: float  # local_s plus the stall of the running sequences
    remote_s: float  # queue wait + compute at the prefill worker + transfer


def placement_costs(x: PlacementInputs) -> PlacementCosts:
    local_s = x.local_tokens / x.local_rate
    remote_s = (x.pool_queued_tokens + x.remote_tokens) / x.prefill_rate
    remote_s += x.transfer_tokens * x.kv_bytes_per_token / x.link_rate
    return PlacementCosts(local_s, local_s * (1 + STALL_WEIGHT * x.decode_running), remote_s)


def prefill_locally(x: PlacementInputs, max_local_tokens: int) -> bool:
    """The `auto` placement: whether the decode worker prefills this prompt itself."""
    if x.decode_waiting > 0 or x.local_tokens > max_local_tokens:
        return False
    c = placement_costs(x)
    return c.local_cost < c.remote_s
