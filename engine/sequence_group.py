"""Several sequences from one prompt: n / best_of samples, or the beams of a beam search.

The request's prompt is prefilled once, as the group's root sequence. When its first token is
due the root forks: the members share every block of the prompt by reference count
(BlockPool.incref), and the scheduler copies the partly filled last block only when a member
first writes into it while another still holds it (copy-on-write).

    root (prompt KV)          after the fork (n = 3), prompt blocks A B C, C partly filled
    [A][B][C]                 seq 0: [A][B][C ]      ref counts A:3 B:3 C:3
                              seq 1: [A][B][C']      first decode of seq 1 copies C -> C'
                              seq 2: [A][B][C'']     ... the last writer keeps C itself

Sampled members (n, best_of) are independent after the fork: member i draws with seed + i
(the same stream an n=1 request with that seed draws). With best_of > n they all finish before
the n with the highest cumulative logprob are returned. A constrained member gets a copy of its
parent's grammar matcher at the fork (beam search takes no constraint). Beams move in lockstep (the scheduler
runs a beam group's decodes together or not at all) and every step BeamSearch decides which
beams continue: a beam picked twice forks, a beam not picked ends and gives its blocks back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from msgspec.structs import replace

from pdserve.engine.beam_search import BeamSearch
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.sequence import Sequence
from pdserve.protocol.sampling import SamplingParams


def member_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Member `index`'s own parameters: seed + index, and logprobs computed when best_of ranks
    by them (reported only if the client asked: Sequence.report_logprobs)."""
    seed = None if sampling.seed is None else (sampling.seed + index) % 2**63
    logprobs = sampling.logprobs
    if logprobs is None and not sampling.streams_choices and not sampling.use_beam_search:
        logprobs = 0
    return replace(sampling, seed=seed, logprobs=logprobs, n=1, best_of=None)


@dataclass(eq=False)
class SequenceGroup:
    sampling: SamplingParams  # the request's
    root: Sequence
    beam: BeamSearch | None = None
    started: bool = False  # forked: the members exist
    live: list[Sequence] = field(default_factory=list)  # running or waiting members; beams best first
    done: list[Sequence] = field(default_factory=list)  # finished sampled members

    @property
    def num_returned(self) -> int:
        return self.sampling.n

    def fork(self, parent: Sequence, pool: BlockPool, sampling: SamplingParams | None = None) -> Sequence:
        """A new member sharing `parent`'s tokens and blocks (each block gains a reference)."""
        child = Sequence(
            parent.request_id,
            list(parent.token_ids),
            parent.num_prompt_tokens,
            sampling or parent.sampling,
            arrival_time=parent.arrival_time,
            status=parent.status,
            num_computed_tokens=parent.num_computed_tokens,
            block_table=list(parent.block_table),
            logprobs=list(parent.logprobs),
            num_cached_tokens=parent.num_cached_tokens,
            block_hashes=list(parent.block_hashes),
            num_registered_blocks=parent.num_registered_blocks,
            group=self,
            cumulative_logprob=parent.cumulative_logprob,
            report_logprobs=parent.report_logprobs,
            grammar=parent.grammar.fork() if parent.grammar is not None else None,
        )
        pool.incref(child.block_table)
        return child

    def fork_sampled(self, pool: BlockPool) -> list[Sequence]:
        """The root becomes member 0; members 1..best_of-1 fork from it. Returns all members."""
        assert not self.started and self.beam is None
        self.started = True
        self.live = [self.root] + [
            self.fork(self.root, pool, member_sampling(self.sampling, i)) for i in range(1, self.sampling.num_seqs)
        ]
        for i, seq in enumerate(self.live):
            seq.seq_index = i
        return self.live

    def ranked(self) -> list[Sequence]:
        """best_of > n: the n finished members with the highest cumulative logprob."""
        return sorted(self.done, key=lambda s: -s.cumulative_logprob)[: self.num_returned]
