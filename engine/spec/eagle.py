"""EAGLE proposals: a one-layer head (spec/eagle_head.py) beside the target guesses k tokens per
sequence from the target's hidden states, over a paged KV pool of its own.

The head's entry at position p reads (target hidden h_p, embedding of token t_{p+1}) and its
output's logits (the target's LM head) guess t_{p+2}. For a sequence of n real tokens, whose
last token t_{n-1} the target computes next (its KV up to p = n - 2):

    head KV:  base .. c-1 | c .. n-2                  | n-1 .. n+k-3
    inputs:   (consumed)  | (h_p, t_{p+1}) one chunk   | (g_{p-1}, d_i) one token per step
    output:                 row n-2 -> d1               | row n-3+i -> d(i+1)

where g is the head's own output (its guess of the next hidden state) and `base` is the first
position whose target hidden state this engine saw. After verification the target's hidden
states of the accepted positions replace the drafts' (the head's KV past c is rolled back and
rebuilt from them), so the head's context always follows the accepted tokens.

Where the hidden states come from: `collect` after every target step (`LLMEngine.finish_step`),
for every position the step computed (post final norm: the LM head's input, as vLLM feeds
EAGLE-1). A prompt the engine prefilled itself (colocated, a decode worker's local prefill)
gives the head its whole context; a prompt whose KV came from a prefill worker (1P1D) or the
prefix cache has no hidden states here, so the head's context starts at the first position the
engine computed (base > 0): nothing crosses the wire, and the head sees fewer tokens (lower
acceptance early in a long-prompt request with a trained head; output unchanged).
Who frees: `release` (finish, preemption) and `release_all_but` (from `Speculator.propose`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pdserve.engine.batch import build_batch
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from pdserve.engine.model_runner import ForwardPass
from pdserve.engine.models.cpu_linear import cpu_linear_kind, relayout_linears
from pdserve.engine.models.llama import ForwardContext, LlamaForCausalLM
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.sequence import SeqStatus, Sequence
from pdserve.engine.spec.eagle_head import load_eagle_head
from pdserve.engine.spec.eagle_hidden import HiddenRows

# Target hidden states a sequence may hold unconsumed (it decodes without proposing: paused,
# or the batch is over disable_by_batch_size); past it the head's context restarts.
MAX_PENDING_ROWS = 512


@dataclass
class _HeadState:
    seq: Sequence  # the target's sequence
    shadow: Sequence  # token_ids[i]: token fed at position base + i; block_table in the head's pool
    base: int  # absolute position of shadow index 0
    hidden: HiddenRows  # target hidden states by position, from the last consumed one on
    consumed: int = 0  # shadow entries whose head KV was built from target hidden states


class EagleRunner:
    """Owns the head, its KV pool and block pool, and each sequence's head state. Called by
    `Speculator.propose` / `release` and `LLMEngine.finish_step` (engine thread only)."""

    def __init__(
        self,
        folder: str,
        target: LlamaForCausalLM,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
    ) -> None:
        self.target = target
        self.head = load_eagle_head(folder, target, dtype, device, max_model_len)
        self.model_config: ModelConfig = self.head.cfg
        if device.type == "cpu":
            relayout_linears(self.head, cpu_linear_kind(dtype))
        self.kv_cache = allocate_kv_cache(KVCacheSpec.for_model(self.head.cfg, block_size, dtype), num_blocks, device)
        self.embed = self.head.embed_tokens if self.head.embed_tokens is not None else target.embed_tokens
        self.block_size = block_size
        self.device = device
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.states: dict[int, _HeadState] = {}  # id(seq) -> its head state

    # --- the target's hidden states -------------------------------------------------------
    @torch.inference_mode()
    def collect(self, fp: ForwardPass) -> None:
        """Keep the hidden states a finished target pass computed for each sequence's positions."""
        hidden: torch.Tensor | None = None
        cu, ctx_lens = fp.batch.attn.cu_seqlens_q_cpu, fp.batch.attn.context_lens_cpu
        for i, (seq, _) in enumerate(fp.computed_upto):
            if seq.status is not SeqStatus.RUNNING or seq.group is not None or seq.stop_after_first_token:
                continue
            if hidden is None:
                hidden = self.target.norm(fp.x)  # [T, H]: the LM head's input, every row
            rows = hidden[cu[i] : cu[i + 1]]  # [t, H]
            self._add_rows(seq, ctx_lens[i] - rows.shape[0], rows)

    def _add_rows(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """Hidden states of positions start .. start + len(rows) - 1 for `seq`."""
        st = self.states.get(id(seq))
        if st is not None and (not st.hidden.start < start <= st.hidden.end or len(st.hidden) > MAX_PENDING_ROWS):
            self.release(seq)  # recomputed from its start, skipped positions, or too long unused: restart
            st = None
        if st is None:
            shadow = Sequence(seq.request_id, [], 0, seq.sampling, status=SeqStatus.RUNNING)
            self.states[id(seq)] = _HeadState(seq, shadow, start, HiddenRows(start, rows.clone()))
            return
        st.consumed = min(st.consumed, start - st.base)  # (recomputed positions: the head rebuilds them too)
        st.hidden.add(start, rows.clone())
        st.hidden.drop_before(st.base + st.consumed - 1)  # the last consumed row stays: it may re-feed

    # --- proposals ------------------------------------------------------------------------
    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Greedy drafts for each (sequence, k); [] where the head has no hidden state for the
        sequence yet or its pool has no room."""
        drafts: list[list[int]] = [[] for _ in wants]
        active: list[tuple[int, _HeadState, int]] = []  # (index in wants, state, k)
        feeds: list[torch.Tensor] = []  # per active: the hidden rows its next chunk reads [t, H]
        for i, (seq, k) in enumerate(wants):
            assert seq.num_draft_tokens == 0 and k >= 1
            st = self.states.get(id(seq))
            rows = self._sync(st) if st is not None else None
            if st is not None and rows is not None and self._reserve(st.shadow, st.shadow.num_tokens + k - 1):
                active.append((i, st, k))
                feeds.append(rows)
        chunks = [ScheduledChunk(st.shadow, st.shadow.num_uncomputed) for _, st, _ in active]
        for _, st, _ in active:
            st.consumed = st.shadow.num_tokens  # every chunk row reads a target hidden state
        while active:
            tokens, outs = self._greedy_step(chunks, feeds, [st.base for _, st, _ in active])
            still: list[tuple[int, _HeadState, int]] = []
            chunks, feeds = [], []
            for j, ((i, st, k), token) in enumerate(zip(active, tokens, strict=True)):
                drafts[i].append(token)
                if len(drafts[i]) < k:  # the head reads its own output and guess to guess the next
                    st.shadow.token_ids.append(token)
                    still.append((i, st, k))
                    chunks.append(ScheduledChunk(st.shadow, 1))
                    feeds.append(outs[j : j + 1])
            active = still
        return drafts

    def release(self, seq: Sequence) -> None:
        """Free `seq`'s head KV and hidden states (finished, preempted, or context restarted)."""
        st = self.states.pop(id(seq), None)
        if st is not None and st.shadow.block_table:
            self.pool.free(st.shadow.block_table[::-1])
            st.shadow.block_table = []

    def release_all_but(self, running: Iterable[Sequence]) -> None:
        keep = {id(s) for s in running if s.status is SeqStatus.RUNNING}
        for st in [st for key, st in self.states.items() if key not in keep]:
            self.release(st.seq)

    # --- internals ------------------------------------------------------------------------
    def _sync(self, st: _HeadState) -> torch.Tensor | None:
        """Roll the head's KV back to its consumed entries, queue the real tokens after them;
        returns the target hidden rows the catch-up chunk reads, None when some are missing."""
        real, shadow = st.seq.token_ids, st.shadow
        last = len(real) - 2  # the last position with target KV (and hidden state)
        if st.hidden.end <= last:
            return None
        if st.base + st.consumed > last:  # nothing new since the last proposal: re-feed the last entry
            st.consumed = last - st.base
        if st.consumed < 0:
            return None
        shadow.num_computed_tokens = st.consumed
        del shadow.token_ids[st.consumed :]
        first = st.base + st.consumed  # the first position the chunk computes
        shadow.token_ids.extend(real[first + 1 : last + 2])
        blocks = -(-st.consumed // self.block_size)
        if len(shadow.block_table) > blocks:
            self.pool.free(shadow.block_table[: blocks - 1 : -1])  # tail first
            del shadow.block_table[blocks:]
        return st.hidden.rows(first, last + 1)  # [t, H]

    def _reserve(self, shadow: Sequence, num_tokens: int) -> bool:
        """Head blocks for `num_tokens` entries; False (nothing taken) when the pool is short."""
        need = -(-num_tokens // self.block_size) - len(shadow.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        shadow.block_table.extend(
            self.pool.allocate(need, after=shadow.block_table[-1] if shadow.block_table else None)
        )
        return True

    @torch.inference_mode()
    def _greedy_step(
        self, chunks: list[ScheduledChunk], feeds: list[torch.Tensor], bases: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        """One head pass over `chunks` (each completes its shadow) reading `feeds` as the hidden
        input; the argmax token of each chunk's last row, and those rows' outputs [S, H]."""
        order = sorted(range(len(chunks)), key=lambda j: chunks[j].num_tokens != 1)  # one-token chunks first
        ordered = [chunks[j] for j in order]
        num_decodes = sum(c.num_tokens == 1 for c in ordered)
        batch = build_batch(ordered, num_decodes, self.block_size, self.device)
        for c in ordered:
            c.seq.num_computed_tokens += c.num_tokens
        hidden = torch.cat([feeds[j] for j in order])  # [T, H]
        lens = torch.tensor([c.num_tokens for c in ordered])
        offsets = torch.repeat_interleave(torch.tensor([bases[j] for j in order]), lens).to(self.device)  # [T]
        ctx = ForwardContext(batch.attn, batch.slot_mapping, self.kv_cache)
        x = self.head(self.embed(batch.input_ids), hidden, batch.positions + offsets, ctx)  # [T, H]
        last = x[batch.logits_indices]  # [S, H]
        best = self.target.lm_head(last).float().argmax(dim=-1).tolist()  # [S]
        tokens, outs = [0] * len(chunks), torch.empty_like(last)
        for row, j in enumerate(order):
            tokens[j] = best[row]
            outs[j] = last[row]
        return tokens, outs
