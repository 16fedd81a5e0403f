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
  local prefill (conditional disaggregation): a decode worker whose heartbeats say it holds all
  of the prompt but at most `local_prefill_max_tokens` is asked to take the whole request; it
  does when its own cache confirms that and no other prompt waits for its engine (so a decode
  batch stalls for at most one short prefill at a time); else it grants a lease as usual and the
  prompt goes through the prefill pool.
- `least-loaded`: what each worker holds is ignored. decode: load per seat, then most free KV;
  prefill: queued prompt tokens plus this whole prompt, then fewest in flight. Never local.
- `round-robin`: workers in turn (by worker id, one rotation per pool), whatever they hold or
  carry; a decode worker that refuses passes the turn to the next. Never local.
Every policy is pure: candidates and the gateway's counts in, an order out (unit-tested in
tests/gateway/test_router.py and test_kv_routing.py, no processes).
"""

from __future__ import annotations

import itertools
from typing import Literal

from pdserve.gateway.membership import WorkerEntry

RouterPolicy = Literal["kv-aware", "least-loaded", "round-robin"]
ROUTER_POLICIES: tuple[RouterPolicy, ...] = ("kv-aware", "least-loaded", "round-robin")

# Conditional disaggregation: the longest uncached rest of a prompt a decode worker prefills
# itself instead of a round trip through the prefill pool (measured: docs/benchmarks/README.md).
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 128


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
        self, policy: RouterPolicy = "kv-aware", local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    ):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self._turns: dict[str, itertools.count] = {}  # pool -> requests routed there so far

    @property
    def uses_kv(self) -> bool:
        """Whether the policy reads what workers hold (else the gateway skips hashing for it)."""
        return self.policy == "kv-aware"

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

    def local_prefill_tokens(self, held_tokens: int, prompt_tokens: int) -> int:
        """The `local_prefill_max_tokens` to offer a decode worker holding `held_tokens` of the
        prompt (0: the prompt goes through the prefill pool)."""
        rest = prompt_tokens - held_tokens
        if self.policy != "kv-aware" or held_tokens <= 0 or not 0 < rest <= self.local_prefill_max_tokens:
            return 0  # a prompt it holds nothing of goes to the prefill pool
        return self.local_prefill_max_tokens
