"""The engine every worker kind runs: requests in, one batched step at a time, tokens out.

colocated worker : add_request()        -> step() ... (prefill and decode in mixed batches)
prefill worker   : add_request(prefill_only=True) -> step(on_layer_stored=ship KV) -> first token
decode worker    : add_prefilled() (KV already in leased blocks) -> step() ...

A request with n > 1, best_of or beam search runs as a SequenceGroup (engine/sequence_group.py):
one prefill, then its members fork here (or, disaggregated, on the decode worker from the
first tokens or beam candidates the prefill worker sends: StepOutput.fork -> add_prefilled).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial
from typing import Callable

import torch

from pdserve import kernels
from pdserve.engine.beam_search import BeamSearch, Candidate
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import (
    EngineConfig,
    ModelConfig,
    auto_dtype_reason,
    keeps_weights_quantized,
    quantized,
    resolve_activations,
    resolve_dtype,
    resolve_prompt_linears,
)
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.engine_core import (
    PREFILLED,
    EngineCore,
    EngineInfo,
    EngineStats,
    StepOutput,
)
from pdserve.engine.kv_cache import KvAllocator, KVCacheSpec, allocate_kv_cache, plan_num_blocks
from pdserve.engine.kv_disk_tier import DiskKvTier
from pdserve.engine.kv_offload import KvOffload
from pdserve.engine.model_runner import ForwardPass, ModelRunner, load_model
from pdserve.engine.models.interface import CausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.peer_prefix import PeerPrefix
from pdserve.engine.prefix_cache import BlockHasher
from pdserve.engine.prompt_logprobs import PromptScores
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import SeqStatus, Sequence
from pdserve.engine.sequence_group import SequenceGroup, member_sampling
from pdserve.engine.spec.draft_fit import check_draft_fits
from pdserve.engine.spec.draft_model import DraftRunner
from pdserve.engine.spec.eagle import EagleRunner
from pdserve.engine.spec.speculator import Speculator
from pdserve.engine.spec.verify import num_accepted
from pdserve.engine.structured.matcher import GrammarCache, constrain
from pdserve.kernels import block_gemm
from pdserve.kvtransfer.head_ranges import HeadShard
from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


def _output(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None, reason: str | None) -> StepOutput:
    return StepOutput(seq.request_id, tokens, logprobs, reason, seq, request_done=reason is not None)


class LLMEngine(EngineCore):
    def __init__(
        self,
        config: EngineConfig,
        *,
        kv_allocator: KvAllocator | None = None,
        show_progress: bool = True,
        rank_kv_sends: str | None = None,
    ) -> None:
        """`kv_allocator`: makes the KV pool (rank 0's under tensor parallelism); `rank_kv_sends`: a
        tensor-parallel prefill worker's --kv-payload-mac mode, its ranks sending their own KV heads."""
        self.config = config
        self.device = torch.device(config.device)
        activations = resolve_activations(config.activation_quantization, config.quantization, config.model)
        as_stored = config.tensor_parallel_size == 1 and self.device.type == "cpu" and block_gemm.available()
        prompt_linears = resolve_prompt_linears(config.prompt_linears, activations, as_stored)
        self.model_config = quantized(
            ModelConfig.from_folder(config.model, config.model_impl),
            config.quantization,
            activations,
            blocks_as_stored=as_stored,
            prompt_linears=prompt_linears,
        )
        quantized_weights = keeps_weights_quantized(self.model_config)
        self.dtype = resolve_dtype(config.dtype, self.device, quantized_weights, self.model_config.approx_params)
        if config.dtype == "auto":
            log.info(
                "--dtype auto -> %s (%s)",
                str(self.dtype).removeprefix("torch."),
                auto_dtype_reason(self.dtype, self.device, quantized_weights),
            )
        mc = self.model_config
        self.max_model_len = min(config.scheduler.max_model_len or mc.max_context, mc.max_context)
        self.block_size = config.cache.block_size
        kv_dtype = config.cache.kv_cache_dtype
        self.kv_spec = KVCacheSpec.for_model(mc, self.block_size, self.dtype, kv_dtype)
        self.draft_config = self._draft_config()
        draft_spec = (
            KVCacheSpec.for_model(self.draft_config, self.block_size, self.dtype) if self.draft_config else None
        )
        num_blocks = plan_num_blocks(self.kv_spec, config.cache, self.max_model_len, draft_spec)
        t0 = time.perf_counter()
        sampler = Sampler(mc.eos_token_ids, seed=config.seed)
        if config.tensor_parallel_size > 1:  # rank 0 of N processes (engine/parallel/runner.py)
            from pdserve.engine.parallel.runner import start_tensor_parallel

            args = (config, mc, self.dtype, self.kv_spec, num_blocks, self.max_model_len, sampler, show_progress)
            runner: ModelRunner = start_tensor_parallel(*args, kv_allocator=kv_allocator, kv_payload_mac=rank_kv_sends)
        else:
            model = load_model(
                mc,
                self.dtype,
                self.device,
                self.max_model_len,
                show_progress,
                config.quantization,
                activations=activations,
                prompt_linears=prompt_linears,
            )
            kv_cache = allocate_kv_cache(self.kv_spec, num_blocks, self.device, kv_allocator)
            graphs = self._decode_graphs(model, kv_cache)
            runner = ModelRunner(model, kv_cache, self.block_size, sampler, graphs)
        log.info(
            "model %s loaded in %.1fs: dtype %s, %d KV blocks x %d tokens (%.1f MiB%s)",
            mc.path,
            time.perf_counter() - t0,
            self.dtype,
            num_blocks,
            self.block_size,
            num_blocks * (self.kv_spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec else 0)) / 2**20,
            f", of it {num_blocks * draft_spec.bytes_per_block / 2**20:.1f} MiB the draft model's layers"
            if draft_spec
            else "",
        )
        caching = config.cache.enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        # a block's KV depends on the model, its dtype, the KV cache's dtype and the block's place in the prefix
        self.hasher = BlockHasher(mc.fingerprint(self.dtype, kv_dtype), self.block_size) if caching else None
        self.scheduler = Scheduler(config.scheduler, self.pool, self.block_size, self.hasher)
        if mc.every_layer_windowed and self.draft_config is None:  # (a draft reads the same blocks)
            self.scheduler.release_window = max(mc.layer_windows)
        self.runner = runner
        self.seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self._timed_step: tuple[int, bool, float] | None = None  # (decoding, speculated, start) of a step
        self.grammars = GrammarCache(config.model, mc.vocab_size, mc.eos_token_ids)
        spec = config.speculative
        self.speculator = (
            Speculator(spec, self.max_model_len, self._draft_runner(num_blocks, show_progress))
            if spec is not None
            else None
        )
        self.offload = self._disk_tier(config, mc.fingerprint(self.dtype, kv_dtype), runner) if caching else None
        self.scheduler.offload = self.offload
        draft = self.draft
        # blocks shared with peer workers: one pool with every KV head (rank 0 holds only its own)
        sharing = caching and config.tensor_parallel_size == 1
        self.peers = PeerPrefix(self.pool, [self.kv_cache, *self._draft_pools()]) if sharing else None
        self.info = EngineInfo(
            model_fingerprint=mc.fingerprint(self.dtype, kv_dtype),
            draft_fingerprint=self.draft_config.fingerprint(self.dtype) if self.draft_config is not None else None,
            num_layers=mc.num_layers,
            draft_num_layers=draft.kv_cache.shape[0] if draft is not None else 0,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.kv_spec.num_kv_heads,
            head_dim=self.kv_spec.head_dim,
            kv_dtype=str(self.kv_spec.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            device=str(self.device),
            caches_prefixes=self.hasher is not None,
            shares_prefixes=self.peers is not None,
        )

    def _decode_graphs(self, model: CausalLM, kv_cache: torch.Tensor) -> DecodeGraphs | None:
        """CUDA graphs for decode steps: on CUDA with the Triton kernels, the native model path,
        unless --enforce-eager."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.model_config.impl == "transformers":
            return None
        if not kernels.attention.use_triton(kv_cache):
            return None
        return DecodeGraphs(model, kv_cache, self.config.scheduler.max_num_seqs, self.max_model_len)

    def _draft_config(self) -> ModelConfig | None:
        """The draft model's config (--speculative-config '{"model": DIR, ...}'), checked to
        speak the target's tokens; None without one (an EAGLE head is no draft model)."""
        spec = self.config.speculative
        if spec is None or spec.model is None or spec.method == "eagle":
            return None
        draft_cfg = ModelConfig.from_folder(spec.model, "auto")
        check_draft_fits(self.model_config, draft_cfg)
        return draft_cfg

    def _draft_runner(self, num_blocks: int, show_progress: bool) -> DraftRunner | EagleRunner | None:
        """The draft model beside the target, its KV in the target's blocks (same ids); or an
        EAGLE head ('{"method": "eagle", ...}') with a one-layer KV pool of its own."""
        spec = self.config.speculative
        if spec is not None and spec.method == "eagle" and spec.model is not None:
            return self._eagle_runner(spec.model, num_blocks)
        if self.draft_config is None:
            return None
        t0 = time.perf_counter()
        runner = DraftRunner(
            self.draft_config, self.dtype, self.device, self.max_model_len, self.pool, self.block_size, show_progress
        )
        log.info("draft model %s loaded in %.1fs", self.draft_config.path, time.perf_counter() - t0)
        return runner

    def _eagle_runner(self, folder: str, num_blocks: int) -> EagleRunner:
        target = self.runner.model
        if not isinstance(target, LlamaForCausalLM) or target.tp is not None:
            raise ValueError(
                "EAGLE speculation needs the native model path (a Llama-family target) without tensor parallelism"
            )
        check_draft_fits(self.model_config, ModelConfig.from_folder(folder, "native"))
        args = (folder, target, self.dtype, self.device, self.max_model_len, self.block_size, num_blocks)
        return EagleRunner(*args)

    @property
    def draft(self) -> DraftRunner | None:
        """The draft model's runner (its KV is shipped and admitted with the target's), if any."""
        d = self.speculator.draft if self.speculator is not None else None
        return d if isinstance(d, DraftRunner) else None

    @property
    def kv_cache(self) -> torch.Tensor:
        """[L, 2, N, bs, Hkv, D]; under tensor parallelism rank 0's KV heads only."""
        return self.runner.kv_cache

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel rank processes, the disk tier's writer,
        after its queued writes); idempotent."""
        self.runner.close()
        if self.offload is not None:
            self.offload.tier.close()
            self.offload = self.scheduler.offload = None

    def _disk_tier(self, config: EngineConfig, fingerprint: str, runner: ModelRunner) -> KvOffload | None:
        """--kv-offload-dir's tier over this engine's pools (the draft model's too: same block ids)."""
        cache = config.cache
        if cache.kv_offload_dir is None:
            return None
        if config.tensor_parallel_size > 1:
            raise ValueError(
                "--kv-offload-dir with tensor parallelism is not supported (each rank holds its own heads)"
            )
        caches = [runner.kv_cache]
        identity = (
            f"{fingerprint}/bs{self.block_size}/{list(runner.kv_cache.shape[:2])}{list(runner.kv_cache.shape[3:])}"
        )
        if self.draft_kv_cache is not None:
            caches.append(self.draft_kv_cache)
            identity += f"/draft {self.draft_config.fingerprint(self.dtype) if self.draft_config else ''}"
        tier = DiskKvTier(cache.kv_offload_dir, identity, cache.kv_offload_bytes)
        log.info(
            "KV disk tier: %s (%d blocks, %.2f of %.2f GiB used)",
            tier.dir,
            tier.num_blocks,
            tier.bytes_used / 2**30,
            cache.kv_offload_bytes / 2**30,
        )
        return KvOffload(tier, self.pool, caches, self.block_size)

    @property
    def num_layers(self) -> int:
        """The layers a launched step's `run_layers` walks (the runner's own count)."""
        return self.runner.num_layers

    @property
    def draft_kv_cache(self) -> torch.Tensor | None:
        draft = self.draft
        return draft.kv_cache if draft is not None else None

    @property
    def kv_head_shards(self) -> list[HeadShard]:
        return self.runner.kv_head_shards

    def find(self, request_id: str) -> Sequence | None:
        return self.seqs.get(request_id)

    def set_max_num_seqs(self, limit: int) -> None:
        self.scheduler.max_num_seqs = limit

    def stats(self) -> EngineStats:
        sch, pool = self.scheduler, self.pool
        return EngineStats(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free,
            num_cached_blocks=pool.num_cached,
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            num_seats=sch.num_seats,
            seq_limit=sch.max_num_seqs,
            steps=self.num_steps,
            preemptions=sch.num_preemptions,
            prefix_query_tokens=sch.prefix_query_tokens,
            prefix_hit_tokens=sch.prefix_hit_tokens,
            has_work=self.has_work(),
            structured_mask_rows=self.grammars.mask_stats.rows,
            structured_mask_seconds=self.grammars.mask_stats.seconds,
            speculation=self.speculator.worker_stats() if self.speculator is not None else {},
            kv_disk=self.offload.stats() if self.offload is not None else {},
        )

    def prefix_cache_changes(self) -> list[tuple[bool, bytes]]:
        events, self.pool.events = self.pool.events or [], []
        return events

    def prefix_cache_hashes(self) -> list[bytes]:
        return self.pool.hashes()

    # --- blocks for a decode worker's leases (EngineCore: one owner, the scheduler) -----------
    def cached_prefix(self, block_hashes: list[bytes]) -> list[int]:
        if self.hasher is None or not block_hashes:
            return []
        if self.offload is not None:  # (a decode worker's reservation: what disk holds is not shipped)
            self.offload.load_prefix(block_hashes)
        return self.pool.lookup(block_hashes)

    def can_reserve(self, num_blocks: int, prefix: list[int]) -> bool:
        return self.scheduler.can_reserve(num_blocks, prefix)

    # --- prefix blocks shared with peer workers (engine/peer_prefix.py) ------------------------
    def _draft_pools(self) -> list[torch.Tensor]:
        return [self.draft_kv_cache] if self.draft_kv_cache is not None else []

    def prefix_hashes(self, prompt_token_ids: list[int]) -> list[bytes]:
        if self.hasher is None:
            return []
        return self.hasher.hashes(prompt_token_ids, (len(prompt_token_ids) - 1) // self.block_size)

    def export_prefix(self, block_hashes: list[bytes]) -> list[torch.Tensor]:
        return self.peers.export(block_hashes) if self.peers is not None else []

    def import_prefix(self, prompt_hashes: list[bytes], first: int, layers: list[memoryview]) -> int:
        return self.peers.load(prompt_hashes, first, layers) if self.peers is not None else 0

    def reserve_blocks(self, num_blocks: int, prefix: list[int]) -> list[int]:
        return self.scheduler.reserve(num_blocks, prefix)

    def release_blocks(self, block_ids: list[int]) -> None:
        self.scheduler.release_reserved(block_ids)

    def _holds_prefix(self, prefix: list[int], prompt: list[int]) -> bool:
        """The prefix blocks hold this very prompt's KV (their hashes, checked against the prompt
        the prefill worker sent, not only the gateway's word)."""
        if not prefix:
            return True
        if self.hasher is None:
            return False
        return [self.pool.block_hash[b] for b in prefix] == self.hasher.hashes(prompt, len(prefix))

    # --- intake ---------------------------------------------------------------------------
    def _new_sequence(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, *, prefill_only: bool = False
    ) -> Sequence:
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id}")
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_model_len:
            cap = self.model_config.max_context
            why = f" (the model's limit: {self.model_config.max_context_reason})" if self.max_model_len == cap else ""
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room in max_model_len {self.max_model_len}{why}"
            )
        bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of vocabulary: {bad[:5]}")
        seq = Sequence(request_id, list(prompt), len(prompt), sampling)
        if sampling.structured is not None:
            self._attach_grammar(seq)
        if sampling.is_group:
            self._make_group(seq, check_room=not prefill_only)
        self.seqs[request_id] = seq
        return seq

    def _attach_grammar(self, seq: Sequence) -> None:
        """The sequence's matcher (compiled here, synchronously: < 1 ms, engine/structured/); a
        migrated request's matcher first consumes the tokens it generated before (its prompt's tail)."""
        c = seq.sampling.structured
        assert c is not None
        seq.grammar = grammar = self.grammars.new(c)
        if c.resumed_tokens > len(seq.token_ids):
            raise ValueError("structured.resumed_tokens exceeds the prompt")
        for t in seq.token_ids[len(seq.token_ids) - c.resumed_tokens :]:
            if not grammar.accept(t):
                raise ValueError(f"the resumed tokens break the constraint: {grammar.error}")

    def _make_group(self, root: Sequence, check_room: bool) -> None:
        sp = root.sampling
        if check_room:  # every member at full length, sharing only the prompt's full blocks
            worst = sp.worst_case_blocks(len(root.token_ids), self.block_size)
            if worst > self.pool.num_blocks:
                raise ValueError(
                    f"{sp.num_seqs} sequences of up to {sp.max_tokens} tokens need up to {worst} KV blocks;"
                    f" this worker has {self.pool.num_blocks}"
                )
        group = SequenceGroup(sp, root)
        if sp.use_beam_search:
            group.beam = BeamSearch.for_request(
                sp, self.model_config.eos_token_ids, root.num_tokens, self.max_model_len
            )
        else:
            root.sampling = member_sampling(sp, 0)
        root.group = group
        root.report_logprobs = sp.logprobs is not None

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *, prefill_only: bool = False
    ) -> Sequence:
        seq = self._new_sequence(request_id, prompt_token_ids, sampling, prefill_only=prefill_only)
        seq.stop_after_first_token = prefill_only
        if sampling.prompt_logprobs is not None:
            seq.prompt_scores = PromptScores(len(prompt_token_ids), sampling.prompt_logprobs)
        elif self.offload is not None and self.hasher is not None:  # read its blocks on disk ahead
            self.offload.prefetch(self.hasher.extend(seq, (seq.num_tokens - 1) // self.block_size))
        self.scheduler.add(seq)
        return seq

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        first_logprob: TokenLogprob | None,
        sampling: SamplingParams,
        block_ids: list[int],
        fork: list[TokenLogprob] | None = None,
        draft_kv_blocks: int = 0,
        num_prefix_blocks: int = 0,
    ) -> list[StepOutput]:
        """Admit a sequence whose prompt KV sits in `block_ids` (owned from now on by the engine:
        a refused request's blocks go back before the ValueError). `draft_kv_blocks`: the last
        that many of them hold the draft model's KV too (shipped by the prefill worker); without
        it the draft rebuilds its KV at the first proposal. `num_prefix_blocks`: the first that
        many were found in this pool's prefix cache (`cached_prefix`): checked to hold this prompt.

        The first token was sampled by the prefill worker (it told the gateway); returns a
        finished output when that token already ends the request (the blocks are freed). A group
        forks here from `fork` (StepOutput.fork) and returns its members' first outputs.
        """
        try:
            if not self._holds_prefix(block_ids[:num_prefix_blocks], prompt_token_ids):
                raise ValueError("the cached prefix blocks do not hold this prompt")
            if sampling.is_group and len(fork or ()) < sampling.num_seqs:
                raise ValueError("a sequence group needs its members' first tokens (KvDone.fork)")
            seq = self._new_sequence(request_id, prompt_token_ids, sampling)
        except ValueError:
            self.scheduler.release_reserved(block_ids)
            raise
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(prompt_token_ids)
        self._publish(seq, seq.num_computed_tokens)
        self.scheduler.add_running(seq)
        if self.draft is not None and seq.group is None:
            self.draft.admit(seq, draft_kv_blocks)
        group = seq.group
        if group is not None:
            assert fork is not None
            if group.beam is not None:
                return self._beam_step(group, [seq], [Candidate(0, t.token_id, t.logprob) for t in fork])
            return self._accept(
                [
                    (m, t.token_id, t if m.sampling.logprobs is not None else None)
                    for m, t in zip(self._fork(group), fork)
                ]
            )
        reason = self._append_token(seq, first_token, first_logprob)
        if reason is not None:
            self._finish(seq, reason)
            return [_output(seq, [], None, reason)]
        return []

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._abort_seq(seq)
        return True

    def stop_member(self, request_id: str, seq_index: int) -> StepOutput | None:
        """End one member of a group whose choices stream (n, best_of == n) now: the gateway
        matched a stop string in its text. Its blocks go back (shared ones lose a reference) and
        the others run on. Returns its last output (no tokens, reason "stop"), or None when no
        such member is running here (it ended already, the group has not forked yet, or its
        choices return whole when it ends: best_of > n, beams)."""
        seq = self.seqs.get(request_id)
        group = seq.group if seq is not None else None
        if group is None or not group.started or not group.sampling.streams_choices:
            return None
        member = next((m for m in group.live if m.seq_index == seq_index), None)
        if member is None:
            return None
        self.scheduler.finish(member, "stop")
        group.live.remove(member)
        group.done.append(member)
        if not group.live:
            self.seqs.pop(request_id, None)
        return StepOutput(request_id, [], None, "stop", member, not group.live, seq_index)

    def _abort_seq(self, seq: Sequence) -> None:
        group = seq.group
        if group is None or not group.started:
            self._finish(seq, "abort")
            return
        for member in list(group.live):
            self.scheduler.finish(member, "abort")
        group.live.clear()
        self.seqs.pop(seq.request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.speculator is None:
            return self.scheduler.schedule()
        started = time.perf_counter()
        self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        decoding = len(sched.decodes) + len(sched.speculative)
        # a pure decode step is timed (to its last token, finish_step): does speculating pay here?
        self._timed_step = (decoding, bool(sched.speculative), started) if decoding and not sched.prefills else None
        for seq in sched.preempted:
            self.speculator.release(seq)
        verifying = {id(c.seq) for c in sched.speculative}
        for seq in self.scheduler.running:  # drafts of a sequence left out of this step go
            if seq.num_draft_tokens and id(seq) not in verifying:
                seq.drop_drafts()
        return sched

    def schedule_prefill(self, in_flight: frozenset[int], token_budget: int) -> SchedulerOutput:
        return self.scheduler.schedule(in_flight, token_budget)

    def queued_prompt_tokens(self) -> int:
        return sum(s.num_uncomputed for s in (*self.scheduler.running, *self.scheduler.waiting))

    def run_layers(self, fp: ForwardPass, count: int | None = None) -> None:
        self.runner.run_layers(fp, count)

    def logits(self, fp: ForwardPass) -> torch.Tensor | None:
        return self.runner.logits(fp)

    def execute(self, sched: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None) -> list[StepOutput]:
        if sched.is_empty:
            return []
        fp = self.launch(sched, on_layer_stored)
        self.runner.run_layers(fp)
        return self.finish_step(fp, self.runner.logits(fp))

    # execute() in parts, for a caller that runs the layers elsewhere (prefill lanes)
    def launch(self, sched: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None) -> ForwardPass:
        """Start a step: its batch is built and its chunks count as computed from now on, so the
        next schedule() already plans the chunks after them (the caller runs the layers)."""
        if self.draft is not None:  # a prefill worker: the draft's KV too, into the same blocks
            draft_layer = None if on_layer_stored is None else self._draft_layer_hook(on_layer_stored)
            self.draft.prefill([c for c in sched.prefills if c.seq.stop_after_first_token], draft_layer)
        fp = self.runner.begin(sched, on_layer_stored)
        for chunk in sched.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            # (drafts' KV is published only once verification accepts them)
            fp.computed_upto.append((chunk.seq, chunk.seq.num_computed_tokens - chunk.seq.num_draft_tokens))
        self.num_steps += 1
        return fp

    def _draft_layer_hook(self, on_layer_stored: Callable[[int], None]) -> Callable[[int], None]:
        """The draft's layer j reported as layer L + j (L: the target's layers), as it ships."""
        num_layers = self.model_config.num_layers
        return lambda layer: on_layer_stored(num_layers + layer)

    def finish_step(self, fp: ForwardPass, logits: torch.Tensor | None) -> list[StepOutput]:
        """Sample from a launched step's logits (`ModelRunner.logits`) and account the tokens."""
        for seq, upto in fp.computed_upto:  # their KV is written now: reusable by others
            self._publish(seq, upto)
        if self.speculator is not None and isinstance(self.speculator.draft, EagleRunner):
            self.speculator.draft.collect(fp)  # the head reads the target's hidden states
        for scored, part in fp.prompt_scores:  # (by the step's head pass: ModelRunner.logits)
            if scored.prompt_scores is not None:
                scored.prompt_scores.add(part)
        if logits is None:
            return []
        rows: list[int] = []  # logits rows the sampler draws from, one per sequence in `drawn`
        drawn: list[Sequence] = []
        beams: dict[int, dict[int, int]] = {}  # id(group) -> {id(beam): logits row}
        results: list[StepOutput] = []
        for i, chunk in enumerate(fp.batch.sampled):
            seq, group = chunk.seq, chunk.seq.group
            r, drafts = fp.batch.logits_offsets[i], fp.batch.num_drafts[i]
            if seq.is_finished:
                continue  # (ended while its step ran: prefill lanes)
            if drafts:
                results.append(self._verify(seq, logits[r : r + drafts + 1]))  # [d + 1, V]
            elif group is None or (group.started and group.beam is None):
                rows.append(r)
                drawn.append(seq)
            elif group.started:  # a beam: the group's step waits for all its beams' rows
                beams.setdefault(id(group), {})[id(seq)] = r
            elif seq.stop_after_first_token:  # a prefill worker: the decode worker forks
                results.append(self._prefilled_group(seq, logits[r]))
            elif group.beam is not None:
                results += self._beam_step(group, [seq], group.beam.candidates(logits[r : r + 1], [0.0], 0))
            else:  # the root's first token: fork, every member draws its own from this row
                members = self._fork(group)
                rows += [r] * len(members)
                drawn += members
        if drawn:
            grammars = [s.grammar for s in drawn]
            out = self.runner.sampler(
                logits[rows],
                [s.sampling for s in drawn],
                [s.prompt_token_ids for s in drawn],
                [s.output_token_ids for s in drawn],
                mask=partial(constrain, grammars=grammars, stats=self.grammars.mask_stats) if any(grammars) else None,
            )
            results += self._accept(list(zip(drawn, out.token_ids, out.logprobs, strict=True)))
        for group_rows in beams.values():
            seq = next(s for s in fp.batch.sampled if id(s.seq) in group_rows).seq
            group = seq.group
            assert group is not None and group.beam is not None
            assert len(group_rows) == len(group.live), "beams decode in lockstep"
            scores = [b.cumulative_logprob for b in group.live]
            rows_of = logits[[group_rows[id(b)] for b in group.live]]  # [W, V]
            cands = group.beam.candidates(rows_of, scores, group.live[0].num_output_tokens)
            results += self._beam_step(group, list(group.live), cands)
        if self._timed_step is not None and self.speculator is not None:
            decoding, speculated, started = self._timed_step
            self._timed_step = None
            emitted = sum(len(o.new_token_ids) for o in results)
            self.speculator.payoff.observe(decoding, speculated, time.perf_counter() - started, emitted)
        return self._with_prompt_logprobs(results)

    @staticmethod
    def _with_prompt_logprobs(results: list[StepOutput]) -> list[StepOutput]:
        """The first output of each request whose prompt is scored whole carries its scores
        (once: a group's root holds them for all its members, best_of > n until its end)."""
        out = []
        for r in results:
            root = r.seq.group.root if r.seq.group is not None else r.seq
            scores = root.prompt_scores
            if scores is not None and scores.complete:
                root.prompt_scores = None
                r = replace(r, prompt_logprobs=scores.message())
            out.append(r)
        return out

    # --- speculation (engine/spec/) ---------------------------------------------------------
    def _verify(self, seq: Sequence, rows: torch.Tensor) -> StepOutput:
        """A speculating sequence's step (engine/spec/verify.py): rows [d + 1, V] are the target's
        logits after its last real token and after each of its d drafts. Its tokens are drawn
        row by row exactly as without speculation (same sampler, same state), each appended
        through `_append_token`, while they confirm the drafts; the rejected drafts' KV is
        dropped: `num_computed_tokens` rolled back, blocks past the new end freed (never
        registered with the prefix cache: `_publish` only covers accepted tokens)."""
        assert self.speculator is not None
        drafts = seq.drop_drafts()
        real = seq.num_tokens
        seq.num_computed_tokens = real  # the drafts' KV counts once they are accepted
        sp = seq.sampling
        plain = seq.grammar is None and sp.greedy and not sp.uses_penalties and sp.logprobs is None
        targets = rows.argmax(dim=-1).tolist() if plain and seq.num_output_tokens >= sp.min_tokens else None
        emitted: list[int] = []
        logprobs: list[TokenLogprob] = []
        reason = None
        for j in range(len(drafts) + 1):
            if targets is not None:
                token, logprob = targets[j], None
            else:
                mask = (
                    None
                    if seq.grammar is None
                    else partial(constrain, grammars=[seq.grammar], stats=self.grammars.mask_stats)
                )
                out = self.runner.sampler(rows[j : j + 1], [sp], [seq.prompt_token_ids], [seq.output_token_ids], mask)
                token, logprob = out.token_ids[0], out.logprobs[0]
            reason = self._append_token(seq, token, logprob)
            emitted.append(token)
            if logprob is not None:
                logprobs.append(logprob)
            if reason is not None or j == len(drafts) or token != drafts[j]:
                break
        self.speculator.observe(seq, len(drafts), num_accepted(drafts, emitted))
        if reason is not None:
            self._finish(seq, reason)
        else:
            seq.num_computed_tokens = real + len(emitted) - 1  # the last emitted token has no KV yet
            self.scheduler.truncate(seq, -(-seq.num_tokens // self.block_size))
            self._publish(seq, seq.num_computed_tokens)
        return _output(seq, emitted, logprobs or None, reason)

    # --- groups: n, best_of, beams --------------------------------------------------------
    def _fork(self, group: SequenceGroup) -> list[Sequence]:
        members = group.fork_sampled(self.pool)
        for m in members[1:]:
            self.scheduler.add_forked(m)
        return members

    def _prefilled_group(self, root: Sequence, row: torch.Tensor) -> StepOutput:
        """A group's root done on a prefill worker: the first tokens (or beam candidates) from
        its logits row [V] go with the KV; the decode worker forks from them."""
        group = root.group
        assert group is not None
        if group.beam is not None:
            fork = [TokenLogprob(c.token, c.score, [], []) for c in group.beam.candidates(row[None], [0.0], 0)]
        else:
            k = group.sampling.num_seqs
            params = [member_sampling(group.sampling, i) for i in range(k)]
            # every member's first token obeys the root's constraint
            mask = (
                None
                if root.grammar is None
                else partial(constrain, grammars=[root.grammar] * k, stats=self.grammars.mask_stats)
            )
            out = self.runner.sampler(row.expand(k, -1), params, [root.prompt_token_ids] * k, [[]] * k, mask)
            fork = [lp or TokenLogprob(t, 0.0, [], []) for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
        self._finish(root, PREFILLED)
        return StepOutput(root.request_id, [], None, PREFILLED, root, request_done=True, fork=fork)

    def _accept(self, drawn: list[tuple[Sequence, int, TokenLogprob | None]]) -> list[StepOutput]:
        """Append each sequence's new token; finish those it ends; the outputs to send."""
        results = []
        for seq, token, logprob in drawn:
            reason = self._append_token(seq, token, logprob)
            group = seq.group
            if group is None:
                if reason is not None:
                    self._finish(seq, reason)
                results.append(_output(seq, [token], [logprob] if logprob is not None else None, reason))
                continue
            if logprob is not None:
                seq.cumulative_logprob += logprob.logprob
            if reason is not None:
                self.scheduler.finish(seq, reason)
                group.live.remove(seq)
                group.done.append(seq)
                if not group.live:
                    self.seqs.pop(seq.request_id, None)
            if group.sampling.streams_choices:
                lps = [logprob] if logprob is not None and seq.report_logprobs else None
                done = reason is not None and not group.live
                results.append(StepOutput(seq.request_id, [token], lps, reason, seq, done, seq.seq_index))
            elif not group.live:  # best_of > n: all done, the n best return whole
                results += self._whole(group.ranked())
        return results

    def _beam_step(self, group: SequenceGroup, parents: list[Sequence], cands: list[Candidate]) -> list[StepOutput]:
        """One beam search step: fork the beams picked twice or more, extend the picked, end
        the rest (their blocks go back now); when the search ends, the n best return whole."""
        assert group.beam is not None
        step = group.beam.step(cands, [p.output_token_ids for p in parents])
        group.started = True
        picked: set[int] = set()
        plan: list[tuple[Sequence, Candidate]] = []
        for c in step.running:  # forks copy their parent before any parent grows
            parent = parents[c.parent]
            if id(parent) in picked:
                child = group.fork(parent, self.pool)
                self.scheduler.add_forked(child)
                plan.append((child, c))
            else:
                picked.add(id(parent))
                plan.append((parent, c))
        for parent in parents:
            if id(parent) not in picked:
                self.scheduler.finish(parent, "abort")  # a dropped beam
        group.live = [seq for seq, _ in plan]
        for seq, c in plan:
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.score
        if not step.done:
            return []
        self.seqs.pop(group.root.request_id, None)
        best = []
        for hyp in group.beam.best(group.num_returned):
            root = group.root
            seq = Sequence(
                root.request_id, root.prompt_token_ids + hyp.output_token_ids, root.num_prompt_tokens, root.sampling
            )
            seq.status, seq.finish_reason, seq.cumulative_logprob = SeqStatus.FINISHED, hyp.finish_reason, hyp.score
            best.append(seq)
        return self._whole(best)

    @staticmethod
    def _whole(seqs: list[Sequence]) -> list[StepOutput]:
        """A group's returned choices, each in one output, in rank order."""
        return [
            StepOutput(
                s.request_id,
                s.output_token_ids,
                s.logprobs if s.report_logprobs and s.logprobs else None,
                s.finish_reason,
                s,
                request_done=i == len(seqs) - 1,
                seq_index=i,
            )
            for i, s in enumerate(seqs)
        ]

    def step(self, on_layer_stored: Callable[[int], None] | None = None) -> list[StepOutput]:
        return self.execute(self.schedule(), on_layer_stored)

    def _publish(self, seq: Sequence, computed: int) -> None:
        """Register `seq`'s full blocks whose KV is computed (its first `computed` tokens) with
        the prefix cache. Called only once their KV is written: a step's after its layers ran."""
        if self.hasher is None or seq.is_finished or not seq.block_table:
            return
        full = min(computed // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = self.hasher.extend(seq, full)
        for i in range(seq.num_registered_blocks, full):
            b = seq.block_table[i]
            self.pool.register(b, hashes[i])
            if self.offload is not None and self.pool.block_hash[b] == hashes[i]:
                self.offload.written(b, hashes[i])
        seq.num_registered_blocks = full

    # --- outcomes -------------------------------------------------------------------------
    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> str | None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        sp = seq.sampling
        n_out = seq.num_output_tokens
        if seq.grammar is not None:
            if not seq.grammar.accept(token):  # (a masked row cannot draw it: min_tokens' EOS ban may force one)
                log.warning("request %s: token %d refused by its grammar: %s", seq.request_id, token, seq.grammar.error)
                return "stop"
            if seq.grammar.terminated:  # the structure is complete
                return "stop"
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in self.model_config.eos_token_ids:
                return "stop"
            if token in sp.stop_token_ids:
                return "stop"
        if n_out >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        if seq.stop_after_first_token:
            return PREFILLED
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.release(seq)
        self.seqs.pop(seq.request_id, None)

    # --- conveniences (tests, offline use) ------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; returns output token ids per prompt (n = 1)."""
        return [choices[0] for choices in self.generate_choices(prompts, sampling)]

    def generate_choices(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[list[int]]]:
        """Run prompts to completion; returns each prompt's n choices' output token ids."""
        outputs: dict[str, list[list[int]]] = {}
        for i, p in enumerate(prompts):
            self.add_request(f"gen-{i}", p, sampling)
            outputs[f"gen-{i}"] = [[] for _ in range(sampling.n)]
        while self.has_work():
            for o in self.step():
                outputs[o.request_id][o.seq_index].extend(o.new_token_ids)
        return [outputs[f"gen-{i}"] for i in range(len(prompts))]
