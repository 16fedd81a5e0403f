"""The engine's speculation: drafts for a step's decode-ready sequences, and the counters.

Who calls: `LLMEngine.schedule` calls `propose` before the scheduler plans the step (the drafts
sit at the end of `seq.token_ids`, `seq.num_draft_tokens` of them, until the step's
verification in `LLMEngine.finish_step` removes them and calls `observe`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine.measured_choice import MeasuredChoice
from pdserve.engine.sequence import SeqStatus, Sequence
from pdserve.engine.spec.adaptive import DraftLength
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.ngram import propose_ngram

if TYPE_CHECKING:
    from pdserve.engine.spec.draft_model import DraftRunner
    from pdserve.engine.spec.eagle import EagleRunner

# A step with drafts runs its decodes as chunks (no one-call fused decode for any of them): it
# speculates only with at least this many drafts per decoding sequence, else drops them all.
MIN_DRAFTS_PER_SEQ = 0.5


@dataclass
class SpecStats:
    """vLLM's spec-decode counters (totals since start)."""

    num_drafts: int = 0  # verifications (sequence-steps that carried drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def as_worker_stats(self) -> dict[str, Any]:
        """The counters as `WorkerStats` fields (protocol/messages.py), for heartbeats."""
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_accepted_per_pos": list(self.accepted_per_pos),
        }


class Speculator:
    def __init__(
        self, cfg: SpeculativeConfig, max_model_len: int, draft: DraftRunner | EagleRunner | None = None
    ) -> None:
        """`draft`: the draft model's or EAGLE head's runner (methods "draft_model", "eagle"), else
        n-gram lookup."""
        assert (draft is not None) == (cfg.method in ("draft_model", "eagle"))
        self.cfg = cfg
        self.draft = draft
        self.payoff = MeasuredChoice()  # whether speculating pays at a batch size, measured
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_pos=[0] * cfg.num_speculative_tokens)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Decode-ready (only its last token uncomputed), alone (groups and beams never
        speculate: their members share blocks copy-on-write), not prefill-only."""
        return (
            seq.status is SeqStatus.RUNNING
            and seq.num_uncomputed == 1
            and seq.num_draft_tokens == 0
            and seq.group is None
            and not seq.stop_after_first_token
        )

    def propose(self, running: Iterable[Sequence]) -> None:
        """Append drafts to the eligible sequences, unless the step has too many decodes
        (`disable_by_batch_size`), speculating does not pay at its batch size (`payoff`), or it
        has too few drafts to pay for itself (`MIN_DRAFTS_PER_SEQ`)."""
        running = list(running)
        if self.draft is not None:
            self.draft.release_all_but(running)  # (ended or preempted sequences' draft KV)
        ready = [s for s in running if self.eligible(s)]
        if not ready or len(ready) > self.cfg.disable_by_batch_size:
            return
        if self.cfg.measure_payoff and not self.payoff.allow(len(ready)):
            return
        cfg = self.cfg
        wants: list[tuple[Sequence, int]] = []
        for seq in ready:
            if seq.draft_length is None:
                seq.draft_length = DraftLength(cfg.num_speculative_tokens)
            # never past max_tokens or max_model_len: drafts beyond the last token emitted are waste
            room = min(seq.sampling.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if room < 1:
                continue
            k = min(seq.draft_length.wanted(), room)
            if k >= 1:
                wants.append((seq, k))
        if self.draft is not None:
            guesses = self.draft.propose(wants)
        else:
            guesses = [propose_ngram(s.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max) for s, k in wants]
        proposed: list[Sequence] = []
        for (seq, _), drafts in zip(wants, guesses, strict=True):
            if drafts and seq.grammar is not None:
                drafts = drafts[: seq.grammar.valid_prefix(drafts)]  # only tokens the grammar allows
            if drafts:
                seq.add_drafts(drafts)
                proposed.append(seq)
        if sum(s.num_draft_tokens for s in proposed) < MIN_DRAFTS_PER_SEQ * len(ready):
            for seq in proposed:
                seq.drop_drafts()

    def worker_stats(self) -> dict[str, Any]:
        """`stats` and, with a draft model, where its prompt KV came from, as `WorkerStats` fields."""
        out = self.stats.as_worker_stats()
        c = getattr(self.draft, "counts", None)  # a draft model's (an EAGLE head has no prompt KV to ship)
        if c is not None:
            out.update(
                spec_draft_kv_shipped_tokens=c.shipped,
                spec_draft_kv_cached_tokens=c.cached,
                spec_draft_kv_rebuilt_tokens=c.rebuilt,
            )
        return out

    def release(self, seq: Sequence) -> None:
        """`seq` finished or was preempted: its draft KV (if any) goes back."""
        if self.draft is not None:
            self.draft.release(seq)

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """One verification of `seq`: `accepted` of its `proposed` drafts confirmed."""
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += proposed
        st.num_accepted_tokens += accepted
        for i in range(accepted):
            st.accepted_per_pos[i] += 1
        if seq.draft_length is not None:
            seq.draft_length.observe(proposed, accepted)
