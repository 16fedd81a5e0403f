"""Ships KV to decode workers layer by layer, while the forward pass goes on.

`prepare` gives the model's `on_layer_stored` hook for one step. For every chunk in the step that
belongs to a disaggregated request, after layer l stored its KV it sends the blocks the chunk
touched, mapped onto the decode worker's leased blocks:

    prompt tokens        [0 ........ start ====chunk==== end)
    P block_table        [p0][p1][p2][p3][p4]            blocks start//bs .. ceil(end/bs)-1
    lease.block_ids      [d0][d1][d2][d3][d4]            same indices on D
A block a chunk only partly fills is sent again with the next chunk (its old part unchanged).
A request's first chunk also sends the blocks its prompt found in this worker's prefix cache
(engine/prefix_cache.py): computed by an earlier request, but the decode worker lacks them.
Blocks the decode worker holds already (`lease.prefix_block_ids`, found by the prompt's block
hashes in its own cache) are never sent: the lease's `block_ids` start after them.
With a draft model (engine/spec/draft_model.py) the draft's layers of the same blocks follow as
layers L .. L + Ld - 1 (L: the target's), for requests whose decode worker runs the same draft
(`PrefillRecord.ships_draft`); the others get the target's layers only.
Each layer's send reads the request's lease from the worker's request record at that moment, so a
renewal that arrives while the step computes counts for its remaining layers.
Under tensor parallelism each rank sends its own KV heads (`rank_sends`; kvtransfer/rank_sends.py):
rank 0 sends its pool's, and `rank_plan` gives the step's jobs for the other ranks to send theirs,
each on its own senders, in parallel; a request's KvDone then names their streams (`range_dones`)
so the decode worker waits for every rank's KvRangeDone. Without `rank_sends` rank 0 sends one
frame per distinct rank pool itself (it maps them all). The decode worker re-slices the heads
onto its own ranks either way.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from pdserve.kvtransfer.head_ranges import HeadShard, distinct_shards
from pdserve.kvtransfer.rank_sends import RankKvJob, encode_plan
from pdserve.kvtransfer.sender import KvSender, KvTransferError
from pdserve.prefill_node.request_record import PrefillRecord, TransferStats
from pdserve.protocol.messages import KvDestination, Lease

if TYPE_CHECKING:
    from pdserve.engine.engine_core import SchedulerOutput


@dataclass
class _Job:
    request_id: str
    dest: KvDestination
    src_blocks: list[int]
    dst_blocks: list[int]
    sender: KvSender
    stats: TransferStats = field(default_factory=TransferStats)
    ships_draft: bool = False
    last: bool = False  # the request's last chunk

    @property
    def lease(self) -> Lease:
        return self.dest.lease


class StepTransfers:
    """One step's transfers; the model calls it after each layer stored its KV."""

    def __init__(
        self,
        shards: list[HeadShard],
        jobs: list[_Job],
        lock: threading.Lock,
        records: dict[str, PrefillRecord],
        draft_kv_cache: torch.Tensor | None = None,
        rank_sends: bool = False,
    ) -> None:
        self.shards = shards  # each a pool [L, 2, N, bs, Hkv_rank, D] and its heads (rank 0 sends these)
        self.rank_sends = rank_sends  # the other ranks send their own heads (`rank_plan`)
        self.draft_kv_cache = draft_kv_cache  # [Ld, 2, N, bs, Hkv', D'] (same block ids) or None
        self.jobs = jobs
        self.lock = lock
        self.records = records  # the worker's: its loop renews their leases

    def _lease(self, job: _Job) -> Lease:
        """The job's lease as last renewed (same epoch), else as it was at launch."""
        r = self.records.get(job.request_id)
        if r is not None and r.dest.lease.epoch == job.lease.epoch:
            return r.dest.lease
        return job.lease

    def rank_plan(self) -> bytes:
        """The other ranks' share of this step: every job still sending, its lease as renewed now."""
        if not self.rank_sends:
            return b""
        jobs = [
            RankKvJob(
                j.request_id, msgspec.structs.replace(j.dest, lease=self._lease(j)), j.src_blocks, j.dst_blocks, j.last
            )
            for j in self.jobs
            if j.stats.error is None
        ]
        return encode_plan(jobs)

    def __call__(self, layer: int) -> None:
        num_layers = self.shards[0].pool.shape[0]
        draft = layer >= num_layers  # a draft model's layer, numbered after the target's
        if draft:
            assert self.draft_kv_cache is not None
            sources = [(0, self.draft_kv_cache[layer - num_layers])]  # [2, N, bs, Hkv', D']
        else:
            sources = [(s.start, s.pool[layer]) for s in self.shards]  # [2, N, bs, Hkv_rank, D] each
        for job in self.jobs:
            if job.stats.error is not None or (draft and not job.ships_draft):
                continue
            t0 = time.perf_counter()
            try:
                with self.lock:  # senders are shared by the worker's lanes and its loop
                    for head_start, kv_layer in sources:
                        job.stats.bytes += job.sender.send_layer(
                            job.request_id,
                            self._lease(job),
                            layer,
                            kv_layer,
                            job.src_blocks,
                            job.dst_blocks,
                            kv_head_start=head_start,
                        )
            except KvTransferError as e:  # lease expired, decode worker gone: fail this request only
                job.stats.error = f"KV transfer failed: {e}"
            job.stats.seconds += time.perf_counter() - t0


class KvStreamer:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_size: int,
        lock: threading.Lock | None = None,
        shards: list[HeadShard] | None = None,
        draft_kv_cache: torch.Tensor | None = None,
        rank_sends: bool = False,
    ) -> None:
        """`shards`: a tensor-parallel engine's rank pools (`ModelRunner.kv_head_shards`, rank 0's
        first); `draft_kv_cache`: a draft model's pool (its layers shipped after the target's);
        `rank_sends`: ranks 1.. send their own heads (the engine's `rank_kv_sends`)."""
        self.kv_cache = kv_cache  # [L, 2, N, bs, Hkv, D]
        shards = shards or [HeadShard(0, kv_cache.shape[4], kv_cache)]
        self.rank_sends = rank_sends and len(shards) > 1
        # what rank 0 sends: its own pool (the ranks send theirs), else one pool per head range
        self.shards = shards[:1] if self.rank_sends else distinct_shards(shards)
        # the other ranks' streams a KvDone names: one per head range that is not rank 0's
        self.range_dones = len(distinct_shards(shards)) - 1 if self.rank_sends else 0
        self.draft_kv_cache = draft_kv_cache  # [Ld, 2, N, bs, Hkv', D'] or None
        self.block_size = block_size
        self.lock = lock or threading.Lock()  # held around every send to a decode worker

    def prepare(self, sched: SchedulerOutput, records: dict[str, PrefillRecord]) -> StepTransfers:
        """Plan a step's transfers (before it launches: block tables and chunk starts are final)."""
        bs = self.block_size
        jobs = []
        for chunk in sched.prefills:
            seq = chunk.seq
            r = records.get(seq.request_id)
            if r is None:
                continue
            dest = r.dest
            start = seq.num_computed_tokens
            end = start + chunk.num_tokens
            b0 = 0 if start <= seq.num_cached_tokens else start // bs  # first chunk: the cached prefix too
            b1 = -(-end // bs)
            held = len(dest.lease.prefix_block_ids)  # D holds these already: nothing to send
            b0 = max(b0, held)
            if b0 >= b1:
                continue
            jobs.append(
                _Job(
                    seq.request_id,
                    dest,
                    seq.block_table[b0:b1],
                    dest.lease.block_ids[b0 - held : b1 - held],
                    r.sender,
                    r.transfer,
                    r.ships_draft,
                    last=end >= seq.num_prompt_tokens,
                )
            )
            r.transfer.rank_streams = self.range_dones  # they send its KV too: D waits for them
        return StepTransfers(self.shards, jobs, self.lock, records, self.draft_kv_cache, self.rank_sends)
