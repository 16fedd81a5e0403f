"""One generation request inside an engine: tokens, progress, blocks, sampling, outcome."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams


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
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
