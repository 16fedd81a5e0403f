"""Where a request goes: the router, one policy for every pool (`--router`).

- `kv-aware` (default): KV reuse first, then load.
  decode: a worker holding more of the prompt's leading blocks goes first, unless it lacks the
  room for the rest (free KV blocks) or its seats are taken (running + reserving >= max seqs);
  ties, and workers without room, by load: requests this gateway has in flight there or is
  reserving (counted the moment it asks, so a burst spreads before any heartbeat reports it)
  per seat, then most free KV.
  prefill (and colocated): the least expected work before this prompt's first token: the prompt
  tokens this gateway has routed there that have no first token yet, plus this prompt's tokens
  the worker does not hold; ties by fewest requests in flight.
  prefill placement (conditional disaggregation, `--prefill-placement`, for every prompt,
  cached or not): `auto` weighs prefilling the prompt's uncached rest on the chosen decode
  worker against the prefill pool (gateway/prefill_placement.py: remote = the pool's queued
  tokens ahead + this prompt's compute there + its KV transfer; local = its compute on the
  decode worker x (1 + STALL_WEIGHT x that worker's running sequences)), with rates measured by
  the gateway (gateway/placement_rates.py). Local only when cheaper, at most
  `local_prefill_max_tokens` (the hard cap) and when no other prompt waits for that worker's
  engine; the decode worker checks the last two again and, if they fail there, grants a lease
  as usual and the prompt goes through the prefill pool. `remote` (the default, the rule before
  `auto`): the prefill pool, except a prompt the decode worker holds all but at most
  `local_prefill_max_tokens` of (0: never). `local`: always the decode worker (no cap, even
  behind its waiting prompts) when it has a seat.
- `least-loaded`: what each worker holds is ignored. decode: load per seat, then most free KV;
  prefill: queued prompt tokens plus this whole prompt, then fewest in flight. `auto` placement
  is `remote` here (the cost model needs what workers hold); `local` and `remote` apply.
- `round-robin`: workers in turn (by worker id, one rotation per pool), whatever they hold or
  carry; a decode worker that refuses passes the turn to the next. Placement as least-loaded.
Every policy is pure: candidates and the gateway's counts in, an order out (unit-tested in
tests/gateway/test_router.py and test_kv_routing.py, no processes).
"""

from __future__ import annotations

import itertools
from typing import Literal

from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.prefill_placement import (
    DEFAULT_PREFILL_PLACEMENT,
    PREFILL_PLACEMENTS,
    PlacementInputs,
    PrefillPlacement,
    prefill_locally,
)

RouterPolicy = Literal["kv-aware", "least-loaded", "round-robin"]
ROUTER_POLICIES: tuple[RouterPolicy, ...] = ("kv-aware", "least-loaded", "round-robin")

# Conditional disaggregation: the longest uncached rest of a prompt a decode worker prefills
# itself under `auto` placement (measured: docs/benchmarks/README.md, prefill_placement.md).
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 128
DEFAULT_ROUTER: RouterPolicy = "kv-aware"
LOCAL_ALWAYS_MAX_TOKENS = 1 << 30  # placement `local`: any prompt


def _has_room(w: WorkerEntry, held_blocks: int, prompt_tokens: int) -> bool:
    seats = w.info.max_num_seqs or 1 << 30
    need = -(-prompt_tokens // w.info.kv_layout.block_size)
    return w.stats.kv_blocks_free >= need - held_blocks and w.stats.num_running + w.reserving < seats


def _load(w: WorkerEntry) -> float:
    """Requests this gateway has there or is reserving, per seat."""
    return (w.inflight + w.reserving) / max(1, w.info.max_num_seqs)


def decode_order(candidates: list[WorkerEntry], held_blocks: dict[str, int], prompt_tokens: int) -> list[WorkerEntry]:
    """kv-aware: decode workers to ask for a lease, in turn."""

    def key(w: WorkerEntry) -> tuple[int, float, int]:
        held = held_blocks.get(w.worker_id, 0)
        held = held if _has_room(w, held, prompt_tokens) else 0
        return (-held, _load(w), -w.stats.kv_blocks_free)

    return sorted(candidates, key=key)


def pick_prefill(
    candidates: list[WorkerEntry], held_tokens: dict[str, int], queued_tokens: dict[str, int], prompt_tokens: int
) -> WorkerEntry:
    """kv-aware: the prefill worker with the least expected work ahead of this prompt's first token."""

    def key(w: WorkerEntry) -> tuple[int, int]:
        uncached = prompt_tokens - held_tokens.get(w.worker_id, 0)
        return (queued_tokens.get(w.worker_id, 0) + uncached, w.inflight)

    return min(candidates, key=key)


class Router:
    """One policy's choices; holds only the round-robin positions."""

    def __init__(
        self,
        policy: RouterPolicy = DEFAULT_ROUTER,
        local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
        placement: PrefillPlacement = DEFAULT_PREFILL_PLACEMENT,
    ):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        if placement not in PREFILL_PLACEMENTS:
            raise ValueError(f"prefill placement must be one of {', '.join(PREFILL_PLACEMENTS)}, got {placement!r}")
        if local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {local_prefill_max_tokens}")
        self.policy = policy
        self.placement = placement
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self._turns: dict[str, itertools.count] = {}  # pool -> requests routed there so far

    def _rotation(self, pool: str, candidates: list[WorkerEntry]) -> list[WorkerEntry]:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        start = next(self._turns.setdefault(pool, itertools.count())) % len(ordered)
        return ordered[start:] + ordered[:start]

    def decode_order(
        self, candidates: list[WorkerEntry], held_blocks: dict[str, int], prompt_tokens: int
    ) -> list[WorkerEntry]:
        """Decode workers to ask for a lease, in turn."""
        if self.policy == "kv-aware":
            return decode_order(candidates, held_blocks, prompt_tokens)
        if self.policy == "least-loaded":
            return sorted(candidates, key=lambda w: (_load(w), -w.stats.kv_blocks_free))
        return self._rotation("decode", candidates)

    def pick_prefill(
        self,
        pool: str,
        candidates: list[WorkerEntry],
        held_tokens: dict[str, int],
        queued_tokens: dict[str, int],
        prompt_tokens: int,
    ) -> WorkerEntry:
        """The worker of `pool` (prefill or colocated) that computes this prompt."""
        if self.policy == "kv-aware":
            return pick_prefill(candidates, held_tokens, queued_tokens, prompt_tokens)
        if self.policy == "least-loaded":
            return pick_prefill(candidates, {}, queued_tokens, prompt_tokens)
        return self._rotation(pool, candidates)[0]

    @property
    def weighs_placement(self) -> bool:
        """Whether each prompt's placement is decided by the cost model (else fixed)."""
        return self.placement == "auto" and self.policy == "kv-aware"

    def local_prefill_offer(self, held_tokens: int, prompt_tokens: int, x: PlacementInputs | None) -> int:
        """The `local_prefill_max_tokens` to offer the decode worker about to be asked for this
        prompt, of which its heartbeats say it holds `held_tokens` (0: the prefill pool); `x`
        (None: no prefill worker to weigh against) is read only when `weighs_placement`."""
        if self.placement == "local":
            return LOCAL_ALWAYS_MAX_TOKENS
        if self.policy != "kv-aware":
            return 0
        if self.placement == "remote":  # only the short held rest of a prompt (the rule before auto)
            rest = prompt_tokens - held_tokens
            return self.local_prefill_max_tokens if held_tokens > 0 and 0 < rest <= self.local_prefill_max_tokens else 0
        if x is None:
            return 0
        return self.local_prefill_max_tokens if prefill_locally(x, self.local_prefill_max_tokens) else 0
