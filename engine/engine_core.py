"""The engine's one door: everything a worker (decode_node/, prefill_node/) or the worker runtime
(runtime/) asks of an engine goes through `EngineCore`. The block pool and the scheduler are the
engine's alone; no worker touches them (tests/test_engine_boundary.py keeps it so).

Who calls what, per worker kind (each from its loop thread, the only thread that calls in,
except `run_layers`/`logits`, which a prefill worker's lanes call on a launched step):

    colocated : add_request -> schedule -> execute ...             abort, stop_member
    prefill   : add_request(prefill_only) -> schedule_prefill -> launch
                  -> [lanes: run_layers, logits] -> finish_step    abort
    decode    : cached_prefix, can_reserve, reserve_blocks          (a lease is granted)
                  -> add_prefilled (the lease's blocks become a sequence's)
                  | release_blocks (the lease ended without KV)
                -> schedule -> execute ...                          abort, stop_member,
                set_max_num_seqs (AIMD)
    every one : stats() for heartbeats, info for registration

Block ownership: every block of the pool is free, cached (registered, unowned), a sequence's
(the scheduler allocates and frees it: admission, growth, copy-on-write, sliding window,
preemption, finish) or reserved for something outside the engine (a decode worker's lease:
`reserve_blocks` hands it out, and it comes back exactly once, through `add_prefilled`, which
makes it a sequence's even when it refuses the request and frees it, or `release_blocks`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast, get_args

from pdserve.protocol.messages import FinishReason, PromptLogprobs, TokenLogprob
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.kv_cache import KvAllocator

    # the step's plan and its pass through the layers, as workers see them (plain data)
    from pdserve.engine.model_runner import ForwardPass as ForwardPass
    from pdserve.engine.scheduler import SchedulerOutput as SchedulerOutput
    from pdserve.engine.sequence import Sequence
    from pdserve.kvtransfer.head_ranges import HeadShard

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
    request_done: bool = False  # the request's last output (a group's: after its last choice)
    seq_index: int = 0  # the choice (n > 1, best_of, beams)
    # a group's root on a prefill worker: each member's first token (n, best_of), or the top
    # candidates for the first beam step, for the decode worker to fork from
    fork: list[TokenLogprob] | None = None
    # the request's first output, when it asked for its prompt's logprobs (engine/prompt_logprobs.py)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_output_tokens(self) -> int:
        """The sequence's output tokens so far, this output's included."""
        return self.seq.num_output_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens its prefill found in the prefix cache (not computed)."""
        return self.seq.num_cached_tokens


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, fixed at start-up: what a worker registers with (WorkerInfo)."""

    model_fingerprint: str  # pools exchanging KV must agree on it
    draft_fingerprint: str | None  # the draft model's, when one runs beside the target
    num_layers: int  # the target's KV layers
    draft_num_layers: int  # the draft's (0: none), shipped after the target's as layers L ..
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # what the pool stores: "float32", "bfloat16", ...; "int8" / "uint8" (--kv-cache-dtype int8 / fp8)
    max_model_len: int
    max_num_seqs: int  # as configured (a decode worker may adapt the limit: set_max_num_seqs)
    max_num_batched_tokens: int  # a step's token budget
    device: str  # "cpu", "cuda:0", ...
    caches_prefixes: bool  # a prefix cache: blocks found again by their hashes
    # its cached blocks can be copied out for peers and peers' blocks loaded in (export_prefix,
    # import_prefix): a prefix cache, one pool holding every KV head (no tensor parallelism)
    shares_prefixes: bool = False


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters and queues (heartbeats, admission decisions)."""

    num_blocks: int
    num_free_blocks: int  # free or cached with no holder: what can be allocated now
    num_cached_blocks: int  # in the prefix cache with no holder (their KV kept; reclaimable)
    num_running: int
    num_waiting: int
    num_seats: int  # running seats taken (a beam group takes one per beam)
    seq_limit: int  # the running-sequence limit now (set_max_num_seqs)
    steps: int
    preemptions: int
    prefix_query_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of them, found cached
    has_work: bool
    structured_mask_rows: int
    structured_mask_seconds: float
    # speculative decoding's counters as WorkerStats fields ({} without speculation)
    speculation: dict[str, Any] = field(default_factory=dict)
    # the prefix cache's disk tier as WorkerStats' kv_disk_* fields ({} without one)
    kv_disk: dict[str, Any] = field(default_factory=dict)


class EngineCore(ABC):
    """The narrow interface workers and the runtime use; `LLMEngine` implements it."""

    info: EngineInfo

    @property
    def num_layers(self) -> int:
        """The target model's layers (a launched step's `run_layers` counts them)."""
        return self.info.num_layers

    # --- requests ---------------------------------------------------------------------------
    @abstractmethod
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, *, prefill_only: bool = False
    ) -> Sequence:
        """Queue a prompt to prefill here (then decode, unless `prefill_only`: a prefill worker's,
        which ends at its first token with PREFILLED). Raises ValueError for a request it cannot run.
        With `sampling.prompt_logprobs` its first output carries them (StepOutput.prompt_logprobs)."""

    @abstractmethod
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
        """Admit a request whose prompt KV another worker wrote into `block_ids` (blocks
        `reserve_blocks` handed out, after the `num_prefix_blocks` found in this pool's prefix
        cache): the engine owns them from this call on, admitted or refused (ValueError, blocks
        freed)."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """End a request held here and free its blocks; False when none is held."""

    @abstractmethod
    def stop_member(self, request_id: str, seq_index: int) -> StepOutput | None:
        """End one streaming member of a group (a stop string matched); its last output."""

    @abstractmethod
    def find(self, request_id: str) -> Sequence | None:
        """The request's sequence while the engine holds it."""

    @abstractmethod
    def has_work(self) -> bool:
        """Sequences waiting or running."""

    # --- blocks for a decode worker's leases ------------------------------------------------
    @abstractmethod
    def cached_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest leading run of these full-block hashes ([] without a
        prefix cache); nothing is taken."""

    # --- prefix blocks shared with peer workers (kvtransfer/prefix_exporter.py, prefix_fetcher.py)
    @abstractmethod
    def prefix_hashes(self, prompt_token_ids: list[int]) -> list[bytes]:
        """The hashes of the prompt's full blocks a prefill may take from the cache (all but the
        block holding its last token); [] without a prefix cache."""

    @abstractmethod
    def export_prefix(self, block_hashes: list[bytes]) -> list[torch.Tensor]:
        """Copies of the leading run of these blocks this pool holds, one tensor per pool (the
        target's, then a draft model's: [L, 2, n, bs, Hkv, W] on the CPU); [] when none is held
        or `info.shares_prefixes` is off. The blocks stay cached."""

    @abstractmethod
    def import_prefix(self, prompt_hashes: list[bytes], first: int, layers: list[memoryview]) -> int:
        """Load blocks a peer exported (one payload per layer, target's then draft's, each
        [2, k, bs, Hkv, W]) as `prompt_hashes[first : first + k]`: those extending the leading run
        held now, as free room allows, become cached blocks; returns how many. Loop thread only."""

    @abstractmethod
    def can_reserve(self, num_blocks: int, prefix: list[int]) -> bool:
        """Whether `reserve_blocks(num_blocks, prefix)` would succeed now."""

    @abstractmethod
    def reserve_blocks(self, num_blocks: int, prefix: list[int]) -> list[int]:
        """Take `prefix` (blocks `cached_prefix` found) and `num_blocks` new blocks after them for
        a lease; returns the new ones. They come back through add_prefilled or release_blocks."""

    @abstractmethod
    def release_blocks(self, block_ids: list[int]) -> None:
        """Give back reserved blocks that never became a sequence's (a lease ended without KV)."""

    # --- steps ------------------------------------------------------------------------------
    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next step (decode tokens first, then prefill chunks; speculation's drafts)."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> list[StepOutput]:
        """Run a planned step: the model's layers, then sampling; the step's outputs."""

    @abstractmethod
    def step(self) -> list[StepOutput]:
        """schedule() then execute()."""

    @abstractmethod
    def schedule_prefill(self, in_flight: frozenset[int], token_budget: int) -> SchedulerOutput:
        """A prefill worker's next step: chunks of sequences not in a step in flight
        (`in_flight`: id() of theirs), up to `token_budget` tokens; no speculation."""

    @abstractmethod
    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of the sequences held that are neither computed nor launched yet."""

    @abstractmethod
    def launch(self, sched: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None) -> ForwardPass:
        """Start a step whose layers the caller runs (`run_layers`, then `logits`)."""

    @abstractmethod
    def run_layers(self, fp: ForwardPass, count: int | None = None) -> None:
        """Run a launched step's next `count` layers (all when None); any thread."""

    @abstractmethod
    def logits(self, fp: ForwardPass) -> torch.Tensor | None:
        """A launched step's logits once its layers ran; any thread."""

    @abstractmethod
    def finish_step(self, fp: ForwardPass, logits: torch.Tensor | None) -> list[StepOutput]:
        """Sample from a launched step's logits and account its tokens; the step's outputs."""

    # --- limits, KV memory and stats ----------------------------------------------------------
    @abstractmethod
    def set_max_num_seqs(self, limit: int) -> None:
        """The running-sequence limit from the next step on (a decode worker's AIMD)."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Counters and queue lengths now."""

    @abstractmethod
    def prefix_cache_changes(self) -> list[tuple[bool, bytes]]:
        """(registered?, block hash) events since the last call; the first call starts recording."""

    @abstractmethod
    def prefix_cache_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds now."""

    @property
    @abstractmethod
    def kv_cache(self) -> torch.Tensor:
        """The target's KV pool [L, 2, N, bs, Hkv, D] (rank 0's heads under tensor parallelism)."""

    @property
    @abstractmethod
    def draft_kv_cache(self) -> torch.Tensor | None:
        """The draft model's KV pool for the same block ids [Ld, 2, N, bs, Hkv, D], if one runs."""

    @property
    @abstractmethod
    def kv_head_shards(self) -> list[HeadShard]:
        """Every rank's KV pool with its head range (one without tensor parallelism)."""

    @abstractmethod
    def close(self) -> None:
        """Stop what the engine started (tensor-parallel rank processes); idempotent."""


def start_engine(
    config: EngineConfig,
    *,
    kv_allocator: KvAllocator | None = None,
    rank_kv_sends: str | None = None,
    on_layer_done: Callable[[], None] | None = None,
) -> EngineCore:
    """A worker's engine: the tokenizer loads in a thread while the model loads (structured
    output's first constraint then costs no tokenizer load), `on_layer_done` is called as a
    step finishes each layer (heartbeats: a long step making progress is not stuck).
    `kv_allocator` makes the KV pool (shared memory); `rank_kv_sends`: LLMEngine."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.structured.matcher import TokenizerLoad

    tokenizer = TokenizerLoad(config.model)  # (overlaps the model load: engine/structured/)
    engine = LLMEngine(config, kv_allocator=kv_allocator, rank_kv_sends=rank_kv_sends)
    engine.runner.on_layer_done = on_layer_done
    engine.grammars.warm_in_background(tokenizer)
    return engine
