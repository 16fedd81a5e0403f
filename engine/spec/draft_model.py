"""Draft-model proposals: a small model of the same tokenizer guesses k tokens per sequence.

The draft runs beside the target in the same engine with its own paged KV pool and block
tables. Each speculating sequence has a shadow `Sequence` here whose `token_ids` are the draft's
view (the real tokens, then the drafts it fed itself) and whose `num_computed_tokens` counts the
tokens with draft KV. A proposal of k drafts for a sequence of n real tokens:

    real:    t0 t1 ... t(c-1) | tc ... t(n-1)      c = tokens whose draft KV still matches
    step 0:  one chunk of tc .. t(n-1) (the prompt, lazily, at the first proposal) -> d1
    step i:  d_i alone (one token per sequence: the draft's ragged batch)          -> d(i+1)
    after:   draft KV for n + k - 1 tokens (t0 .. t(n-1), d1 .. d(k-1))

At the next proposal the KV of drafts the target rejected is rolled back (c = the longest prefix
the shadow shares with the real tokens; blocks past it freed), so the draft's KV always follows
the sequence's accepted tokens. A sequence that decoded without speculation just has a longer
catch-up chunk; a decode worker that got the target's KV from a prefill worker builds the
draft's the same way. Who frees: `release` (the engine calls it when a sequence finishes or is
preempted; `propose` also drops any sequence no longer running).
"""

from __future__ import annotations

from collections.abc import Iterable
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
class _DraftState:
    seq: Sequence  # the target's sequence
    shadow: Sequence  # the draft's view: token_ids, block_table (draft pool), num_computed_tokens
    num_real: int  # shadow.token_ids[:num_real] are the sequence's real tokens (checked)


class DraftRunner:
    """Owns the draft model, its KV pool and block pool, and each speculating sequence's shadow.
    Called by `Speculator.propose` / `Speculator.release` (engine thread only)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        show_progress: bool = True,
    ) -> None:
        self.model_config = cfg
        model = load_model(cfg, dtype, device, max_model_len, show_progress, "none")
        kv_cache = allocate_kv_cache(KVCacheSpec.for_model(cfg, block_size, dtype), num_blocks, device)
        self.runner = ModelRunner(model, kv_cache, block_size, Sampler(cfg.eos_token_ids))
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.states: dict[int, _DraftState] = {}  # id(seq) -> its draft state

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
        """Free `seq`'s draft KV (it finished, or was preempted: it catches up when it returns)."""
        state = self.states.pop(id(seq), None)
        if state is not None and state.shadow.block_table:
            self.pool.free(state.shadow.block_table[::-1])
            state.shadow.block_table = []

    def release_all_but(self, running: Iterable[Sequence]) -> None:
        """Drop the draft KV of every sequence not in `running` (or no longer running)."""
        keep = {id(s) for s in running if s.status is SeqStatus.RUNNING}
        for state in [st for key, st in self.states.items() if key not in keep]:
            self.release(state.seq)

    # --- internals ------------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> _DraftState:
        """`seq`'s state with the draft KV rolled back to what still matches its real tokens."""
        state = self.states.get(id(seq))
        if state is None:
            shadow = Sequence(seq.request_id, [], seq.num_prompt_tokens, seq.sampling, status=SeqStatus.RUNNING)
            state = self.states[id(seq)] = _DraftState(seq, shadow, 0)
        shadow, real = state.shadow, seq.token_ids
        keep = state.num_real  # shadow tokens before it are real; past it, its drafts may differ
        while keep < min(shadow.num_computed_tokens, len(real)) and shadow.token_ids[keep] == real[keep]:
            keep += 1
        keep = min(keep, shadow.num_computed_tokens, len(real) - 1)  # the last token is always fed
        shadow.num_computed_tokens = keep
        del shadow.token_ids[keep:]
        shadow.token_ids.extend(real[keep:])
        state.num_real = len(real)
        blocks = -(-keep // self.block_size)
        if len(shadow.block_table) > blocks:
            self.pool.free(shadow.block_table[: blocks - 1 : -1])  # tail first
            del shadow.block_table[blocks:]
        return state

    def _reserve(self, shadow: Sequence, num_tokens: int) -> bool:
        """Draft blocks for `num_tokens` tokens of KV; False (nothing taken) when the pool is short."""
        need = -(-num_tokens // self.block_size) - len(shadow.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        shadow.block_table.extend(
            self.pool.allocate(need, after=shadow.block_table[-1] if shadow.block_table else None)
        )
        return True

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
