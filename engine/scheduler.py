"""Continuous-batching scheduler: pure data in, pure data out (no tensors, no model).

Every step, under a token budget:
  1. running sequences that decode (one uncomputed token) -- decode first, FCFS;
  2. running sequences mid-prompt (chunked prefill) -- next chunk;
  3. waiting sequences, in policy order, while seats (`max_num_seqs`), budget and blocks last:
     FCFS, or shortest-first (fewest prompt tokens left, minus `aging_tokens_per_s` per second
     waited, so a long prompt is not starved); preempted sequences always go first. Both orders
     are within a priority (`SamplingParams.priority`, lower first): a more urgent sequence waits
     ahead of every less urgent one, preempted or not. A sequence
     admitted takes the longest run of its leading full blocks found in the prefix cache and
     computes only the rest (at least its last block, so a step samples its next token).
When a running sequence needs a block and none is free, the least urgent (then latest-arriving)
running sequence not yet in this step's batch, and not more urgent than the one in need, is
preempted (recompute: blocks freed, requeued at the front of its priority with its tokens so
far, so it later resumes with identical output); if there is none, the sequence preempts itself.

Sequence groups (engine/sequence_group.py): a group's root takes a seat for each sequence it
will fork into. A member about to write into a block another member still holds gets a copy
first (copy-on-write: `SchedulerOutput.block_copies`, applied before the step's forward). The
beams of a beam search decode together or not at all, are preempted together, and a beam
recomputed after preemption stops its prefill one token short, so it rejoins the lockstep.

Block lifetimes: this class is the one place the engine's pool frees a block (a sequence's at
finish, preemption, copy-on-write, out of its window or past its accepted drafts; a reservation's
that never became a sequence's). Reservations (`reserve`) are a decode worker's leases, through
`EngineCore.reserve_blocks`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.prefix_cache import BlockHasher
from pdserve.engine.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from pdserve.engine.kv_offload import KvOffload


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # query tokens this step, starting at seq.num_computed_tokens

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last token: a new token is sampled from it."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledChunk] = field(default_factory=list)
    # decodes carrying drafts to verify: the last token + its drafts in one chunk (engine/spec/)
    speculative: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (source, destination) blocks to copy before the forward: copy-on-write of shared blocks
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.speculative + self.prefills  # batch order: decodes first

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.speculative and not self.prefills


class Scheduler:
    def __init__(
        self, cfg: SchedulerConfig, pool: BlockPool, block_size: int, hasher: BlockHasher | None = None
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_size = block_size
        self.hasher = hasher  # None: no prefix cache
        self.offload: KvOffload | None = None  # the prefix cache's disk tier (engine/kv_offload.py)
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache (counter)
        self.prefix_hit_tokens = 0  # of them, found cached (not computed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival (admission) order
        self.max_num_seqs = cfg.max_num_seqs  # seats; a worker may adapt it (decode_node/aimd.py)
        self.num_preemptions = 0  # sequences preempted so far (counter)
        # Every layer attends through a sliding window of at most this many tokens (Mistral): a
        # sequence's blocks wholly before it are freed as it grows (the engine sets it; None: keep)
        self.release_window: int | None = None
        self.num_released_blocks = 0  # blocks given back that way (counter)

    # --- intake -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq` behind every waiting sequence as urgent as it (FCFS within a priority)."""
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, lambda w: w.sampling.priority > seq.sampling.priority)

    def _enqueue(self, seq: Sequence, goes_before: Callable[[Sequence], bool]) -> None:
        """Insert `seq` before the first waiting sequence `goes_before` holds for (else last).
        With one priority (the common case) this is an append, or a push to the front."""
        if not self.waiting or not goes_before(self.waiting[-1]):
            self.waiting.append(seq)
            return
        for i, w in enumerate(self.waiting):
            if goes_before(w):
                self.waiting.insert(i, seq)
                return

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV already sits in its blocks (decode worker after transfer)."""
        assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_seats(self) -> int:
        """Seats taken (of `max_num_seqs`): a group's root, before it forks, takes one a member."""
        return sum(s.seats for s in self.running) + sum(s.seats for s in self.waiting)

    # --- the step -------------------------------------------------------------------------
    def schedule(self, in_flight: frozenset[int] = frozenset(), budget: int | None = None) -> SchedulerOutput:
        """`in_flight`: ids of sequences with a launched step still computing (prefill lanes);
        they get their next chunk if any, but are never preempted (their blocks are in use).
        `budget`: this step's token budget, if less than `max_num_batched_tokens`."""
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens if budget is None else min(budget, self.cfg.max_num_batched_tokens)
        in_batch: set[int] = set()

        for want_decode in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not SeqStatus.RUNNING or id(seq) in in_batch or seq.num_uncomputed == 0:
                    continue  # (none left: its last chunk is in flight)
                if self._decodes(seq) != want_decode:
                    continue
                if seq.num_draft_tokens and self._schedule_drafts(seq, budget, out):
                    in_batch.add(id(seq))
                    budget -= out.speculative[-1].num_tokens
                    continue
                if seq.is_beam and want_decode:
                    budget -= self._schedule_beams(seq, budget, in_batch, in_flight, out)
                    continue
                # a beam recomputing stops one token short: its last token decodes with the others
                n = min(seq.num_uncomputed - (1 if seq.is_beam else 0), budget)
                if not self._reserve_blocks(seq, n, in_batch, in_flight, out):
                    continue  # preempted itself, or (in flight) waits for blocks
                chunk = ScheduledChunk(seq, n)
                (out.decodes if want_decode else out.prefills).append(chunk)
                in_batch.add(id(seq))
                budget -= n

        if self.cfg.policy == "shortest-first" and len(self.waiting) > 1:
            self._order_shortest_first()
        seats = sum(s.seats for s in self.running)
        while self.waiting and budget > 0:
            head = self.waiting[0]
            # a preempted beam group comes back whole: part of it running could hold the blocks
            # the rest waits for, and none of it decodes until all of it runs
            batch = self._unit(head, SeqStatus.WAITING)
            want = sum(s.seats for s in batch)
            if seats + want > self.max_num_seqs and (self.running or want == 1):
                break  # (a group wider than max_num_seqs runs alone)
            plans, left, free = [], budget, self.pool.num_free
            for seq in batch:
                hit = self._cached_prefix(seq)
                cached = len(hit) * self.block_size
                n = min(seq.num_tokens - (1 if seq.is_beam else 0) - cached, left)
                need = -(-(cached + n) // self.block_size) - len(hit)
                free -= need + self.pool.num_evictable(hit)
                left -= n
                plans.append((seq, hit, cached, n, need))
            if free < 0:
                break  # FCFS: the head waits for blocks; nobody overtakes it
            for _, hit, _, _, _ in plans:  # all cached prefixes first: no allocation may evict them
                self.pool.acquire(hit)
            for seq, hit, cached, n, need in plans:
                self.waiting.remove(seq)
                if self.hasher is not None:
                    self.prefix_query_tokens += seq.num_tokens
                    self.prefix_hit_tokens += cached
                seq.block_table = hit
                seq.num_computed_tokens = seq.num_cached_tokens = cached
                seq.num_registered_blocks = len(hit)
                seq.block_table.extend(self._allocate_for(seq, need))
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                seats += seq.seats
                if n > 0:  # (0: a beam whose cached prefix leaves only its last token, which decodes)
                    out.prefills.append(ScheduledChunk(seq, n))
                    in_batch.add(id(seq))
                    budget -= n
        return out

    @staticmethod
    def _decodes(seq: Sequence) -> bool:
        """Whether `seq`'s next chunk is a decode: its one token left past the prompt (the last
        sampled one, with any drafts). A prompt's last token left alone by chunking is a prefill
        chunk: its KV is the prompt's, which a prefill worker ships (prefill_node/kv_streamer.py)
        and a draft model prefills; as a decode it was neither (its KV never reached the decode
        worker). A beam group's prompt tail decodes with its beams (`_schedule_beams`)."""
        return seq.num_uncomputed - seq.num_draft_tokens == 1 and (
            seq.is_beam or seq.num_computed_tokens >= seq.num_prompt_tokens
        )

    def _schedule_beams(
        self, seq: Sequence, budget: int, in_batch: set[int], in_flight: frozenset[int], out: SchedulerOutput
    ) -> int:
        """A beam group's decodes, all of them or none (its step needs every beam's logits):
        only once every beam is running with one token left. Returns the budget used."""
        assert seq.group is not None
        beams = seq.group.live
        if seq is not beams[0] or len(beams) > budget:
            return 0
        if any(b.status is not SeqStatus.RUNNING or b.num_uncomputed != 1 or id(b) in in_batch for b in beams):
            return 0
        need = sum(self._blocks_needed(b, 1) + self._needs_copy(b) for b in beams)
        protect = {id(b) for b in beams}
        if not self._make_room(need, protect, in_batch, in_flight, out, seq.sampling.priority):
            for b in beams:  # the group does not fit now: all of it waits
                self.preempt(b)
                out.preempted.append(b)
            return 0
        for b in beams:
            self._grow(b, 1, out)
            out.decodes.append(ScheduledChunk(b, 1))
            in_batch.add(id(b))
        return len(beams)

    def _schedule_drafts(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        """A decode with drafts (engine/spec/) as one chunk of its last token + drafts, trimmed to
        the budget and to the free blocks: drafts never preempt anyone. False when none is left
        (it then decodes as usual)."""
        self._release_out_of_window(seq)
        n = min(seq.num_uncomputed, budget)
        while n > 1 and not self.pool.can_allocate(self._blocks_needed(seq, n) + self._needs_copy(seq)):
            n -= 1
        seq.drop_drafts(seq.num_uncomputed - n)
        if n <= 1:
            return False
        self._grow(seq, n, out)
        out.speculative.append(ScheduledChunk(seq, n))
        return True

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached run of `seq`'s leading full blocks, leaving at least
        one token (a whole block) to compute: the step that computes it samples the next token.
        None for a prompt scored whole (prompt logprobs need every position's logits)."""
        if self.hasher is None or seq.prompt_scores is not None:
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        hashes = self.hasher.extend(seq, usable)[:usable]
        if self.offload is not None:  # blocks on disk past the RAM-cached run come back first
            self.offload.load_prefix(hashes)
        return self.pool.lookup(hashes)

    def _order_shortest_first(self) -> None:
        now = time.monotonic()
        aging = self.cfg.aging_tokens_per_s

        def key(seq: Sequence) -> tuple[int, int, float]:
            return (
                seq.sampling.priority,
                0 if seq.num_preemptions else 1,
                seq.num_uncomputed - aging * (now - seq.arrival_time),
            )

        self.waiting = deque(sorted(self.waiting, key=key))

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        total = -(-(seq.num_computed_tokens + n) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _needs_copy(self, seq: Sequence) -> int:
        """1 when the block `seq` writes next is shared (copy-on-write), else 0."""
        i = seq.num_computed_tokens // self.block_size
        return int(i < len(seq.block_table) and self.pool.ref_count(seq.block_table[i]) > 1)

    def _reserve_blocks(
        self, seq: Sequence, n: int, in_batch: set[int], in_flight: frozenset[int], out: SchedulerOutput
    ) -> bool:
        self._release_out_of_window(seq)  # (before counting what it needs: they may make the room)
        need = self._blocks_needed(seq, n) + self._needs_copy(seq)
        protect = {id(s) for s in self._unit(seq)} | {id(seq)}
        if not self._make_room(need, protect, in_batch, in_flight, out, seq.sampling.priority):
            if id(seq) in in_flight:
                return False  # its blocks are being written: it waits for blocks instead
            for s in self._unit(seq):
                self.preempt(s)
                out.preempted.append(s)
            return False
        self._grow(seq, n, out)
        return True

    def _make_room(
        self,
        need: int,
        protect: set[int],
        in_batch: set[int],
        in_flight: frozenset[int],
        out: SchedulerOutput,
        priority: int,
    ) -> bool:
        """Preempt the least urgent, then latest-arriving, running sequences (a beam with all its
        group) not in this step's batch, not in flight, not in `protect` and not more urgent than
        `priority` (the sequence in need), until `need` blocks are free."""
        while not self.pool.can_allocate(need):
            candidates = [
                (s.sampling.priority, i, s)
                for i, s in enumerate(self.running)
                if s.sampling.priority >= priority
                and id(s) not in in_batch
                and id(s) not in in_flight
                and not {id(u) for u in self._unit(s)} & protect
            ]
            if not candidates:
                return False
            victim = max(candidates, key=lambda c: c[:2])[2]
            for s in self._unit(victim):
                if id(s) in in_batch or id(s) in in_flight:
                    continue  # (a beam group is scheduled whole: never only part of it)
                self.preempt(s)
                out.preempted.append(s)
        return True

    @staticmethod
    def _unit(seq: Sequence, status: SeqStatus = SeqStatus.RUNNING) -> list[Sequence]:
        """What is preempted (or, waiting, admitted) with `seq`: its beam group's beams in
        `status`, else itself."""
        if seq.is_beam:
            assert seq.group is not None
            return [b for b in seq.group.live if b.status is status]
        return [seq]

    def _release_out_of_window(self, seq: Sequence) -> None:
        """Free `seq`'s leading blocks that no query of it reads again: its next query is at
        position num_computed_tokens, and a query at p reads keys > p - window. Not for a group's
        members (they share blocks and fork) nor a prefill worker's sequences (a step in flight
        may still be shipping their blocks)."""
        window = self.release_window
        if window is None or seq.group is not None or seq.stop_after_first_token:
            return
        dead = min((seq.num_computed_tokens - window + 1) // self.block_size, len(seq.block_table))
        if dead > seq.num_released_blocks:
            self.pool.free(seq.block_table[seq.num_released_blocks : dead][::-1])  # (registered ones stay cached)
            self.num_released_blocks += dead - seq.num_released_blocks
            seq.num_released_blocks = dead

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Blocks for `seq`'s next `n` tokens: a private copy of a shared block it writes into,
        then new blocks (room was made); first the blocks its window has left behind go back."""
        self._release_out_of_window(seq)
        if self._needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            shared = seq.block_table[i]
            (copy,) = self.pool.allocate(1, after=seq.block_table[i - 1] if i else None)
            out.block_copies.append((shared, copy))
            self.pool.free([shared])
            seq.block_table[i] = copy
        seq.block_table.extend(self._allocate_for(seq, self._blocks_needed(seq, n)))

    def _allocate_for(self, seq: Sequence, n: int) -> list[int]:
        """Blocks that continue `seq`'s run when they can (attention reads a run in place)."""
        return self.pool.allocate(n, after=seq.block_table[-1] if seq.block_table else None)

    def add_forked(self, seq: Sequence) -> None:
        """A member forked from a running sequence: it runs from now on (its blocks are shared)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    # --- outcomes -------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens (not drafts), go to the front of the
        queue (of its priority: behind the more urgent)."""
        seq.drop_drafts()
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self._enqueue(seq, lambda w: w.sampling.priority >= seq.sampling.priority)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.drop_drafts()
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def truncate(self, seq: Sequence, keep: int) -> None:
        """Free `seq`'s blocks past its first `keep` (rejected drafts' KV; none is registered)."""
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[: keep - 1 : -1])  # tail first
            del seq.block_table[keep:]

    # --- blocks reserved for something outside the engine (a decode worker's leases) -----------
    def can_reserve(self, num_blocks: int, prefix: list[int]) -> bool:
        """Room for `num_blocks` new blocks once `prefix` (cached blocks, maybe unowned) is held."""
        return num_blocks + self.pool.num_evictable(prefix) <= self.pool.num_free

    def reserve(self, num_blocks: int, prefix: list[int]) -> list[int]:
        """Hold `prefix` and `num_blocks` new blocks right after it; returns the new ones. Each
        comes back once: in a sequence (`add_running`) or through `release_reserved`."""
        self.pool.acquire(prefix)
        return self.pool.allocate(num_blocks, after=prefix[-1] if prefix else None)

    def release_reserved(self, block_ids: list[int]) -> None:
        """Give back reserved blocks that never became a sequence's."""
        self.pool.free(block_ids)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            held = seq.block_table[seq.num_released_blocks :]  # (the window's leftovers went already)
            self.pool.free(held[::-1])  # tail first: LRU-friendly for prefix reuse
            seq.block_table = []
            seq.num_released_blocks = 0
