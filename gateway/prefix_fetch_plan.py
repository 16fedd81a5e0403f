"""Whether the worker chosen to prefill a prompt fetches the prompt's leading blocks from a peer
that holds them (over the KV plane: prefill_node/prefix_sharing.py) instead of computing them.
A pure cost model, beside the placement one (gateway/prefill_placement.py), read off the same
measured rates (gateway/placement_rates.py):

    tokens     = (blocks the peer holds - blocks the chosen worker holds) x block size
    fetch_s    = FETCH_OVERHEAD_S + tokens x KV bytes per token / fetch_rate
    compute_s  = tokens / prefill_rate

Fetch when fetch_s < compute_s, from the peer holding the most leading blocks (ties: the one
listed first). Only blocks a prefill may take from the cache count (`usable_blocks`: all but the
block holding the prompt's last token). The worker waits for the fetch at most `timeout_s` =
max(MIN_FETCH_TIMEOUT_S, compute_s): a fetch slower than computing is cut, and computing follows.

The kv-aware router weighs it too (`effective_held_tokens`): a worker that can fetch a prefix
counts as holding it, less the fetch's cost in tokens it could have computed meanwhile, so an idle
worker beside a busy holder takes the prompt (and so a worker new to the pool warms from its
peers) when that is cheaper than waiting in the holder's queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdserve.protocol.messages import WorkerInfo

FETCH_OVERHEAD_S = 0.005  # connecting, asking, the peer's loop turn and copy-out, for any size
MIN_FETCH_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class FetchRates:
    """The numbers every decision for one prompt shares."""

    block_size: int
    kv_bytes_per_token: int
    prefill_rate: float  # prompt tokens/s computed by a prefill worker
    fetch_rate: float  # KV bytes/s a fetch brings

    def __post_init__(self) -> None:
        if min(self.prefill_rate, self.fetch_rate) <= 0:
            raise ValueError(f"rates must be positive: {self}")


@dataclass(frozen=True)
class FetchPlan:
    peer_id: str
    num_blocks: int  # the prompt's leading blocks to end up with (the peer's, up to the usable ones)
    tokens: int  # of them, tokens the chosen worker lacks: fetched instead of computed
    fetch_s: float
    compute_s: float

    @property
    def timeout_s(self) -> float:
        return max(MIN_FETCH_TIMEOUT_S, self.compute_s)


def plan_fetch(held_blocks: int, peers: dict[str, int], usable_blocks: int, x: FetchRates) -> FetchPlan | None:
    """`held_blocks`: the prompt's leading blocks the chosen worker holds; `peers`: worker id ->
    leading blocks held, for each peer that could export them; None: compute them all."""
    if not peers:
        return None
    peer_id, peer_blocks = max(peers.items(), key=lambda p: p[1])
    n = min(peer_blocks, usable_blocks)
    if n <= held_blocks:
        return None
    tokens = (n - held_blocks) * x.block_size
    fetch_s = FETCH_OVERHEAD_S + tokens * x.kv_bytes_per_token / x.fetch_rate
    compute_s = tokens / x.prefill_rate
    return FetchPlan(peer_id, n, tokens, fetch_s, compute_s) if fetch_s < compute_s else None


def effective_held_tokens(held_tokens: int, plan: FetchPlan | None) -> int:
    """What a worker that would fetch by `plan` counts as holding, for the router: its own, plus
    the fetched tokens less the tokens it could compute in the fetch's time."""
    if plan is None:
        return held_tokens
    return held_tokens + int(plan.tokens * (1 - plan.fetch_s / plan.compute_s))


def can_export_to(peer: WorkerInfo, worker: WorkerInfo) -> bool:
    """Whether `worker` may fetch blocks from `peer`: an export socket, and pools whose blocks are
    interchangeable (model fingerprint with its dtypes, every layout field but the pool's size)."""
    if peer.export_addr is None or peer.worker_id == worker.worker_id:
        return False
    same = msgspec.structs.replace(peer.kv_layout, num_blocks=0) == msgspec.structs.replace(
        worker.kv_layout, num_blocks=0
    )
    return same and peer.model_fingerprint == worker.model_fingerprint
