"""Draft-model proposals: a small model of the same tokenizer guesses k tokens per sequence.

The draft runs beside the target in the same engine. Its paged KV pool has the target's block
count and is indexed by the same block ids: block b holds the target's layers in the target's
pool and the draft's layers in this one, so one block pool, one block table per sequence and one
prefix cache cover both (the memory budget pays for both: engine/kv_cache.py plan_num_blocks).

Each speculating sequence has a shadow `Sequence` here whose `token_ids` are the draft's view
(the real tokens, then the drafts it fed itself), whose `block_table` is the sequence's own and
whose `num_computed_tokens` counts the tokens with draft KV. A proposal of k drafts for a
sequence of n real tokens:

    real:    t0 t1 ... t(c-1) | tc ... t(n-1)      c = tokens whose draft KV still matches
    step 0:  one chunk of tc .. t(n-1) (the prompt, lazily, at the first proposal) -> d1
    step i:  d_i alone (one token per sequence: the draft's ragged batch)          -> d(i+1)
    after:   draft KV for n + k - 1 tokens (t0 .. t(n-1), d1 .. d(k-1))

At the next proposal the KV of drafts the target rejected is rolled back (c = the longest prefix
the shadow shares with the real tokens), so the draft's KV always follows the sequence's
accepted tokens. Blocks the drafts need past the sequence's own end are taken from the pool into
its block table (the verification step writes the target's KV there next; the engine frees what
the rejected drafts leave). Where a sequence starts from KV it did not compute, c starts at what
is known good: `admit` takes the prompt's draft KV shipped by a prefill worker (prefill_node/,
the draft's layers in the same transfer); otherwise the leading full blocks whose draft KV was
computed since the block was last allocated (a prefix-cache hit: `BlockPool.fills` tells), and
the first proposal rebuilds the rest (`DraftKvCounts`: shipped, cached, rebuilt prompt tokens).
Who frees: the engine (the blocks are the sequence's); `release` drops a sequence's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from pdserve.engine.model_runner import ModelRunner, load_model
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdserve.engine.sequence import SeqStatus, Sequence


@dataclass
class DraftKvCounts:
    """Where speculating sequences' prompt draft KV came from (prompt tokens, totals)."""

    shipped: int = 0  # computed by the prefill worker, arrived with the target's KV
    cached: int = 0  # found in blocks whose draft KV was already computed here (prefix cache)
    rebuilt: int = 0  # computed here by the draft (catch-up over the prompt)


@dataclass
class _DraftState:
    seq: Sequence  # the target's sequence
    shadow: Sequence  # the draft's view: token_ids, block_table (the sequence's), num_computed_tokens
    num_real: int  # shadow.token_ids[:num_real] are the sequence's real tokens (checked)


class DraftRunner:
    """Owns the draft model, its KV pool (the engine's block ids) and each speculating
    sequence's shadow. Called by the engine thread only: `Speculator.propose` / `release`,
    `LLMEngine.launch` (`prefill`, a prefill worker) and `add_prefilled` (`admit`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        pool: BlockPool,
        block_size: int,
        show_progress: bool = True,
    ) -> None:
        self.model_config = cfg
        model = load_model(cfg, dtype, device, max_model_len, show_progress, "none")
        self.kv_spec = KVCacheSpec.for_model(cfg, block_size, dtype)
        kv_cache = allocate_kv_cache(self.kv_spec, pool.num_blocks, device)  # [Ld, 2, N, bs, Hkv, D]
        self.runner = ModelRunner(model, kv_cache, block_size, Sampler(cfg.eos_token_ids))
        self.block_size = block_size
        self.pool = pool  # the engine's: a block id names the target's and the draft's KV
        self.states: dict[int, _DraftState] = {}  # id(seq) -> its draft state
        self.valid_fill = [-1] * pool.num_blocks  # pool.fills[b] when b's draft KV was last complete
        self.counts = DraftKvCounts()

    @property
    def kv_cache(self) -> torch.Tensor:
        """[Ld, 2, N, bs, Hkv, D]: the draft's layers of every block."""
        return self.runner.kv_cache

    def prefill(self, chunks: list[ScheduledChunk], on_layer_stored: Callable[[int], None] | None) -> None:
        """A prefill worker's step: the draft's KV for the same prompt chunks as the target's,
        into the same blocks (each chunk's `num_computed_tokens` not yet advanced)."""
        if not chunks:
            return
        fp = self.runner.begin(SchedulerOutput(prefills=list(chunks)), on_layer_stored)
        self.runner.run_layers(fp)
        for c in chunks:
            self._mark_valid(c.seq.block_table[: (c.seq.num_computed_tokens + c.num_tokens) // self.block_size])

    def admit(self, seq: Sequence, shipped_blocks: int) -> None:
        """A decode worker admits `seq` (its prompt's target KV in its blocks). `shipped_blocks` > 0:
        its last that many blocks also arrived with the draft's KV (the leading others were this
        worker's cached prefix): the draft starts from there instead of rebuilding the prompt."""
        n = seq.num_tokens
        held = len(seq.block_table) - shipped_blocks
        if shipped_blocks <= 0 or self._valid_leading(seq.block_table[:held]) < held:
            return  # the first proposal finds what is good (_sync) and rebuilds the rest
        self._mark_valid(seq.block_table[: n // self.block_size])
        state = self._new_state(seq)
        state.shadow.token_ids.extend(seq.token_ids)
        state.shadow.num_computed_tokens = state.num_real = n
        self.counts.cached += held * self.block_size
        self.counts.shipped += n - held * self.block_size

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Greedy drafts for each (sequence, k); [] for a sequence the draft pool has no room for.
        The sequences hold no drafts yet (their last token is the one the target computes next)."""
        drafts: list[list[int]] = [[] for _ in wants]
        active: list[tuple[int, _DraftState, int]] = []  # (index in wants, state, k)
        for i, (seq, k) in enumerate(wants):
            assert seq.num_draft_tokens == 0 and k >= 1
            state = self._sync(seq)
            if self._reserve(state.shadow, seq.num_tokens + k - 1):
                active.append((i, state, k))
                self.counts.rebuilt += max(0, seq.num_prompt_tokens - state.shadow.num_computed_tokens)
        chunks = [ScheduledChunk(st.shadow, st.shadow.num_uncomputed) for _, st, _ in active]
        while active:
            tokens = self._greedy_step(chunks)
            still: list[tuple[int, _DraftState, int]] = []
            chunks = []
            for (i, st, k), token in zip(active, tokens, strict=True):
                drafts[i].append(token)
                if len(drafts[i]) < k:  # the draft feeds its own guess to guess the next
                    st.shadow.token_ids.append(token)
                    still.append((i, st, k))
                    chunks.append(ScheduledChunk(st.shadow, 1))
            active = still
        return drafts

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (it finished, or was preempted: it catches up when it returns). Its
        blocks are its own: the engine frees them."""
        self.states.pop(id(seq), None)

    def release_all_but(self, running: Iterable[Sequence]) -> None:
        """Drop the draft KV of every sequence not in `running` (or no longer running)."""
        keep = {id(s) for s in running if s.status is SeqStatus.RUNNING}
        for state in [st for key, st in self.states.items() if key not in keep]:
            self.release(state.seq)

    # --- internals ------------------------------------------------------------------------
    def _new_state(self, seq: Sequence) -> _DraftState:
        shadow = Sequence(seq.request_id, [], seq.num_prompt_tokens, seq.sampling, status=SeqStatus.RUNNING)
        state = self.states[id(seq)] = _DraftState(seq, shadow, 0)
        return state

    def _sync(self, seq: Sequence) -> _DraftState:
        """`seq`'s state with the draft KV rolled back to what still matches its real tokens."""
        state = self.states.get(id(seq))
        real = seq.token_ids
        if state is None:  # start from the leading blocks whose draft KV is good (cache hits)
            state = self._new_state(seq)
            good = min(self._valid_leading(seq.block_table) * self.block_size, len(real) - 1)
            state.shadow.token_ids.extend(real[:good])
            state.shadow.num_computed_tokens = state.num_real = good
            self.counts.cached += min(good, seq.num_prompt_tokens)
        shadow = state.shadow
        shadow.block_table = seq.block_table  # the same blocks (and list) as the target's
        keep = state.num_real  # shadow tokens before it are real; past it, its drafts may differ
        while keep < min(shadow.num_computed_tokens, len(real)) and shadow.token_ids[keep] == real[keep]:
            keep += 1
        keep = min(keep, shadow.num_computed_tokens, len(real) - 1)  # the last token is always fed
        shadow.num_computed_tokens = keep
        del shadow.token_ids[keep:]
        shadow.token_ids.extend(real[keep:])
        state.num_real = len(real)
        self._mark_valid(seq.block_table[: keep // self.block_size])
        return state

    def _reserve(self, shadow: Sequence, num_tokens: int) -> bool:
        """Blocks for `num_tokens` tokens of KV in the sequence's table; False (nothing taken)
        when the pool is short."""
        need = -(-num_tokens // self.block_size) - len(shadow.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        shadow.block_table.extend(
            self.pool.allocate(need, after=shadow.block_table[-1] if shadow.block_table else None)
        )
        return True

    def _mark_valid(self, blocks: list[int]) -> None:
        """These full blocks hold the draft's KV of their tokens (until reallocated)."""
        fills = self.pool.fills
        for b in blocks:
            self.valid_fill[b] = fills[b]

    def _valid_leading(self, blocks: list[int]) -> int:
        """How many of `blocks`, from the first, hold their draft KV."""
        fills, n = self.pool.fills, 0
        while n < len(blocks) and self.valid_fill[blocks[n]] == fills[blocks[n]]:
            n += 1
        return n

    def _greedy_step(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One draft forward over `chunks` (each completes its shadow); the argmax token of each."""
        order = sorted(range(len(chunks)), key=lambda j: chunks[j].num_tokens != 1)  # one-token chunks first
        ordered = [chunks[j] for j in order]
        decodes = [c for c in ordered if c.num_tokens == 1]
        sched = SchedulerOutput(decodes=decodes, prefills=ordered[len(decodes) :])
        fp = self.runner.begin(sched)
        for c in ordered:
            c.seq.num_computed_tokens += c.num_tokens
        self.runner.run_layers(fp)
        logits = self.runner.logits(fp)
        assert logits is not None and logits.shape[0] == len(chunks)  # [S, V]
        best = logits.argmax(dim=-1).tolist()  # [S]
        tokens = [0] * len(chunks)
        for row, j in enumerate(order):
            tokens[j] = best[row]
        return tokens
