"""The engine every worker kind runs: requests in, one batched step at a time, tokens out.

colocated worker : add_request()        -> step() ... (prefill and decode in mixed batches)
prefill worker   : add_request(prefill_only=True) -> step(on_layer_stored=ship KV) -> first token
decode worker    : add_prefilled() (KV already in leased blocks) -> step() ...
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, cast, get_args

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import EngineConfig, ModelConfig, resolve_dtype
from pdserve.engine.kv_cache import KvAllocator, KVCacheSpec, allocate_kv_cache, plan_num_blocks
from pdserve.engine.model_runner import ForwardPass, ModelRunner, load_model
from pdserve.engine.prefix_cache import BlockHasher
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.protocol.messages import FinishReason, TokenLogprob
from pdserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)

PREFILLED = "prefilled"  # finish reason of a prefill-only sequence that got its first token


def wire_finish_reason(reason: str | None) -> FinishReason | None:
    """An engine finish reason as outputs carry it: a prefill-only sequence's PREFILLED is no end."""
    if reason is None or reason == PREFILLED:
        return None
    if reason not in get_args(FinishReason):
        raise ValueError(f"unknown finish reason {reason!r}")
    return cast(FinishReason, reason)


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # stop | length | abort | prefilled | None (still running)
    seq: Sequence


class LLMEngine:
    def __init__(
        self, config: EngineConfig, *, kv_allocator: KvAllocator | None = None, show_progress: bool = True
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = ModelConfig.from_folder(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.dtype == "auto":
            log.info(
                "--dtype auto -> %s (%s)",
                str(self.dtype).removeprefix("torch."),
                "CUDA"
                if self.device.type == "cuda"
                else "CPU has bf16 matrix units"
                if self.dtype != torch.float32
                else "CPU has no bf16 matrix units (AVX512-BF16/AMX)",
            )
        mc = self.model_config
        self.max_model_len = min(config.scheduler.max_model_len or mc.max_context, mc.max_context)
        self.block_size = config.cache.block_size
        self.kv_spec = KVCacheSpec.for_model(mc, self.block_size, self.dtype)
        num_blocks = plan_num_blocks(self.kv_spec, config.cache, self.max_model_len)
        t0 = time.perf_counter()
        model = load_model(mc, self.dtype, self.device, self.max_model_len, show_progress)
        kv_cache = allocate_kv_cache(self.kv_spec, num_blocks, self.device, kv_allocator)
        log.info(
            "model %s loaded in %.1fs: dtype %s, %d KV blocks x %d tokens (%.1f MiB)",
            mc.path,
            time.perf_counter() - t0,
            self.dtype,
            num_blocks,
            self.block_size,
            num_blocks * self.kv_spec.bytes_per_block / 2**20,
        )
        caching = config.cache.enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=caching)
        # a block's KV depends on the model, its dtype and the block's place in the prefix
        self.hasher = BlockHasher(mc.fingerprint(self.dtype), self.block_size) if caching else None
        self.scheduler = Scheduler(config.scheduler, self.pool, self.block_size, self.hasher)
        self.runner = ModelRunner(model, kv_cache, self.block_size, Sampler(mc.eos_token_ids, seed=config.seed))
        self.seqs: dict[str, Sequence] = {}
        self.num_steps = 0

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    # --- intake ---------------------------------------------------------------------------
    def _new_sequence(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> Sequence:
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id}")
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_model_len {self.max_model_len}")
        bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of vocabulary: {bad[:5]}")
        seq = Sequence(request_id, list(prompt), len(prompt), sampling)
        self.seqs[request_id] = seq
        return seq

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *, prefill_only: bool = False
    ) -> Sequence:
        seq = self._new_sequence(request_id, prompt_token_ids, sampling)
        seq.stop_after_first_token = prefill_only
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
    ) -> StepOutput | None:
        """Admit a sequence whose prompt KV sits in `block_ids` (owned from now on by the engine).

        The first token was sampled by the prefill worker; returns a finished StepOutput when
        that token already ends the request (the blocks are freed), else None.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, sampling)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(prompt_token_ids)
        self._publish(seq, seq.num_computed_tokens)
        self.scheduler.add_running(seq)
        reason = self._append_token(seq, first_token, first_logprob)
        if reason is not None:
            self._finish(seq, reason)
            return StepOutput(request_id, [], None, reason, seq)
        return None

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

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
        fp = self.runner.begin(sched, on_layer_stored)
        for chunk in sched.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            fp.computed_upto.append((chunk.seq, chunk.seq.num_computed_tokens))
        self.num_steps += 1
        return fp

    def finish_step(self, fp: ForwardPass, logits: torch.Tensor | None) -> list[StepOutput]:
        """Sample from a launched step's logits (`ModelRunner.logits`) and account the tokens."""
        for seq, upto in fp.computed_upto:  # their KV is written now: reusable by others
            self._publish(seq, upto)
        sampled, out = self.runner.sample(fp, logits)
        if out is None:
            return []
        results = []
        for chunk, token, logprob in zip(sampled, out.token_ids, out.logprobs):
            seq = chunk.seq
            reason = self._append_token(seq, token, logprob)
            if reason is not None:
                self._finish(seq, reason)
            results.append(StepOutput(seq.request_id, [token], [logprob] if logprob is not None else None, reason, seq))
        return results

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
            self.pool.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = full

    # --- outcomes -------------------------------------------------------------------------
    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> str | None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        sp = seq.sampling
        n_out = seq.num_output_tokens
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
        self.seqs.pop(seq.request_id, None)

    # --- conveniences (tests, offline use) ------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; returns output token ids per prompt."""
        outputs: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            self.add_request(f"gen-{i}", p, sampling)
            outputs[f"gen-{i}"] = []
        while self.has_work():
            for o in self.step():
                outputs[o.request_id].extend(o.new_token_ids)
        return [outputs[f"gen-{i}"] for i in range(len(prompts))]
