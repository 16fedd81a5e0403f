"""One generation request inside an engine: tokens, progress, blocks, sampling, outcome."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.prompt_logprobs import PromptScores
    from pdserve.engine.sequence_group import SequenceGroup
    from pdserve.engine.spec.adaptive import DraftLength
    from pdserve.engine.structured.matcher import Grammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """`token_ids` = prompt + output so far. `num_computed_tokens` of them have KV in the cache.

         prompt (num_prompt_tokens)        output
    |-----------------------------------|---------|
    |<----- num_computed_tokens ----->|              KV present for these
                                      |<- next ->|   scheduled this step (chunk or 1 decode)
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Prefill-only engines finish a sequence once it has its first token.
    stop_after_first_token: bool = False
    # Prefix cache (engine/prefix_cache.py): tokens whose KV was found cached at admission (not
    # computed), chained hashes of its full blocks (computed once), blocks registered so far.
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Leading blocks given back early: every layer's sliding window has passed them, so no query
    # reads them again (engine/scheduler.py `release_window`). Their ids stay in `block_table` as
    # placeholders (positions still index it); the pool may hand them to others.
    num_released_blocks: int = 0
    # Several sequences of one request (engine/sequence_group.py): the group, this one's choice
    # index, the sum of its tokens' log-probabilities (best_of ranks by it; a beam's running
    # score), and whether the client asked for logprobs (best_of computes them regardless).
    group: SequenceGroup | None = None
    seq_index: int = 0
    cumulative_logprob: float = 0.0
    report_logprobs: bool = True
    # Constrained decoding (sampling.structured): the matcher, advanced with every output token.
    grammar: Grammar | None = None
    # Prompt logprobs (sampling.prompt_logprobs) gathered chunk by chunk, until the first output
    # carries them out (None: not asked, or sent already): its prompt skips the prefix cache.
    prompt_scores: PromptScores | None = None
    # Speculation (engine/spec/): the last `num_draft_tokens` of `token_ids` are tentative drafts,
    # appended before a step and removed by its verification; the sequence's adaptive draft length.
    num_draft_tokens: int = 0
    draft_length: DraftLength | None = None

    def add_drafts(self, drafts: list[int]) -> None:
        self.token_ids.extend(drafts)
        self.num_draft_tokens += len(drafts)

    def drop_drafts(self, n: int | None = None) -> list[int]:
        """Remove the last `n` drafts (default: all); returns the removed ones, in order."""
        n = self.num_draft_tokens if n is None else min(n, self.num_draft_tokens)
        if n == 0:
            return []
        dropped = self.token_ids[-n:]
        del self.token_ids[-n:]
        self.num_draft_tokens -= n
        return dropped

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def seats(self) -> int:
        """Sequences it stands for in `max_num_seqs`: a group's root, before it forks, all of them."""
        g = self.group
        return g.sampling.num_seqs if g is not None and not g.started else 1

    @property
    def is_beam(self) -> bool:
        """One of a started beam search's beams (they decode in lockstep)."""
        g = self.group
        return g is not None and g.beam is not None and g.started

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
