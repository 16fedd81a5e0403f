"""What KV each worker holds, as the gateway learns it from heartbeats, and how routing uses it.

Workers report their prefix cache's block ids (protocol/block_hashes.py `short_id`: the first 8
bytes of a block's hash) as `KvDigest`s: deltas since their previous heartbeat, and every few
seconds the whole set. A digest out of sequence (a heartbeat lost) drops that worker's entry
until its next full set, so the index is never confidently wrong for long; and it is only a
hint: the decode worker checks the real hashes itself at reservation.

Scores (unit-tested in tests/gateway/test_kv_routing.py, no processes):
- decode: a worker holding more of the prompt's leading blocks goes first, unless it lacks the
  room for the rest (free KV blocks) or its seats are taken (running + reserving >= max seqs);
  ties, and workers without room, by load: requests this gateway has in flight there or is
  reserving (counted the moment it asks, so a burst spreads before any heartbeat reports it)
  per seat, then most free KV.
- prefill: the least expected work before this prompt's first token: the prompt tokens this
  gateway has routed there that have no first token yet, plus this prompt's tokens the worker
  does not hold; ties by fewest requests in flight.
- local prefill (conditional disaggregation): a decode worker asked first whose heartbeats say
  it holds all of the prompt but at most --local-prefill-max-tokens is asked to take the whole
  request; it does when its own cache confirms that and no other prompt waits for its engine
  (so a decode batch stalls for at most one short prefill at a time); else it grants a lease
  as usual and the prompt goes through the prefill pool.
"""

from __future__ import annotations

from pdserve.gateway.membership import WorkerEntry
from pdserve.protocol.messages import KvDigest

# Conditional disaggregation: the longest uncached rest of a prompt a decode worker prefills
# itself instead of a round trip through the prefill pool (measured: docs/benchmarks/README.md).
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 128


class KvIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}  # worker id -> block ids it holds
        self._seq: dict[str, int] = {}  # worker id -> the last digest applied

    def apply(self, worker_id: str, digest: KvDigest) -> None:
        if digest.full:
            self._held[worker_id] = set(digest.stored)
        elif self._seq.get(worker_id) == digest.seq - 1:
            held = self._held[worker_id]
            held.difference_update(digest.removed)
            held.update(digest.stored)
        else:  # a digest went missing (or this gateway is new): unknown until the next full set
            self._held.pop(worker_id, None)
            self._seq.pop(worker_id, None)
            return
        self._seq[worker_id] = digest.seq

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)
        self._seq.pop(worker_id, None)

    def num_held(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def leading_blocks(self, worker_id: str, block_ids: list[int]) -> int:
        """How many of the prompt's leading blocks the worker holds (0 when unknown)."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for b in block_ids:
            if b not in held:
                break
            n += 1
        return n


def decode_order(candidates: list[WorkerEntry], held_blocks: dict[str, int], prompt_tokens: int) -> list[WorkerEntry]:
    """Decode workers to ask for a lease, in turn (see the module's score)."""

    def has_room(w: WorkerEntry) -> bool:
        seats = w.info.max_num_seqs or 1 << 30
        need = -(-prompt_tokens // w.info.kv_layout.block_size)
        return w.stats.kv_blocks_free >= need - held_blocks.get(w.worker_id, 0) and (
            w.stats.num_running + w.reserving < seats
        )

    def key(w: WorkerEntry) -> tuple[int, float, int]:
        held = held_blocks.get(w.worker_id, 0) if has_room(w) else 0
        load = (w.inflight + w.reserving) / max(1, w.info.max_num_seqs)
        return (-held, load, -w.stats.kv_blocks_free)

    return sorted(candidates, key=key)


def pick_prefill(
    candidates: list[WorkerEntry], held_tokens: dict[str, int], queued_tokens: dict[str, int], prompt_tokens: int
) -> WorkerEntry:
    """The prefill worker with the least expected work ahead of this prompt's first token."""

    def key(w: WorkerEntry) -> tuple[int, int]:
        uncached = prompt_tokens - held_tokens.get(w.worker_id, 0)
        return (queued_tokens.get(w.worker_id, 0) + uncached, w.inflight)

    return min(candidates, key=key)
