"""A request's one record in the gateway (as vLLM v1's `Request`): its state, the workers and
lease it holds, its token order and its output stream, from admission to its end.

    queued --admitted--> prefilling --first output--> decoding --last output--> finished
       ^                    |                            |
       +---- migrating <----+---- a worker it needs is lost (retried on a live pair)

A record is in the `RequestTable` under the id the workers know for its current attempt
(`worker_request_id`: the request id, then `<id>.m2`, ... after a migration), so outputs of an
earlier attempt find nothing. A reservation the gateway gave up on (no answer in time) may still be
taken by its decode worker later, so the attempt goes on under a new id (`<id>.r2`, ...:
`abandon_worker_id`): a late answer, or tokens made under the old id, find nothing either. Outputs go from the socket straight into it (`accept`): put in
token order, then onto its `OutputStream`, with no task in between. Its workers' counts
(`WorkerEntry.inflight`) move only in `hold` and `let_go`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from msgspec.structs import replace

from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.output_stream import OutputStream
from pdserve.gateway.token_order import TokenOrder
from pdserve.protocol.messages import ReserveReply, TokenOutput
from pdserve.protocol.sampling import SamplingParams

RequestState = Literal["queued", "prefilling", "decoding", "migrating", "finished"]


class WorkerLost(Exception):
    reason = "stopped responding"  # what happened to the workers, for the client's error

    def __init__(self, worker_ids: list[str]) -> None:
        super().__init__(", ".join(worker_ids))
        self.worker_ids = worker_ids


@dataclass(eq=False)
class RequestRecord:
    request_id: str  # the gateway's id for it (the client's stream)
    prompt: list[int]
    sampling: SamplingParams
    stream: OutputStream
    state: RequestState = "queued"
    attempt: int = 0
    worker_request_id: str = ""  # this attempt's id at the workers
    attempt_prompt_tokens: int = 0  # the prompt this attempt prefills (+ tokens already streamed)
    prefill: WorkerEntry | None = None  # None: colocated, or a decode worker prefilling it itself
    decode: WorkerEntry | None = None  # the decode (or colocated) worker generating it
    lease_deadline: float = 0.0  # of its lease on `decode`, as last renewed
    local_since: float = 0.0  # monotonic time `decode` took this attempt to prefill itself (0: not local)
    reservation: asyncio.Future[ReserveReply] | None = None  # a ReserveReply waited for
    group: bool = field(init=False)  # n > 1, best_of or beams: choices by `seq_index`
    order: TokenOrder = field(init=False)
    generated: list[int] = field(default_factory=list)  # n = 1: tokens streamed (a migration re-prefills them)
    delivered: dict[int, int] = field(default_factory=dict)  # a group: tokens streamed per choice
    ended_by: str = ""  # the worker whose output ended this attempt ("" : ended here, or not yet)
    outcome: asyncio.Future[None] | None = None  # the attempt's end: None, or WorkerLost
    on_first_output: Callable[[RequestRecord, TokenOutput], None] | None = None
    abandoned_ids: int = 0  # this attempt's worker ids given up on (reservations not answered in time)
    # reconciliation (gateway/reconcile.py): per watched worker, the heartbeat snapshot last
    # looked at, and how many rounds of fresh snapshots in a row named the request nowhere
    seen_snapshots: dict[str, int] = field(default_factory=dict)
    missed_rounds: int = 0

    def __post_init__(self) -> None:
        self.group = self.sampling.is_group
        self.order = TokenOrder(self.choices)

    @property
    def choices(self) -> int:
        return self.sampling.n if self.sampling.is_group else 1

    @property
    def over(self) -> bool:
        return self.outcome is not None and self.outcome.done()

    # --- workers held -----------------------------------------------------------------------
    def hold(self, prefill: WorkerEntry | None, decode: WorkerEntry) -> None:
        self.prefill, self.decode = prefill, decode
        decode.inflight += 1
        if prefill is not None:
            prefill.inflight += 1

    def let_go(self) -> None:
        if self.decode is not None:
            self.decode.inflight -= 1
        if self.prefill is not None:
            self.prefill.inflight -= 1
        self.prefill = self.decode = None

    def watched(self) -> Iterator[WorkerEntry]:
        """The workers this attempt still depends on."""
        if self.state == "prefilling" and self.prefill is not None:
            yield self.prefill
        if self.state in ("prefilling", "decoding") and self.decode is not None:
            yield self.decode

    # --- attempts ---------------------------------------------------------------------------
    def begin_attempt(self) -> None:
        """A new attempt: a fresh id at the workers and a fresh token order; n = 1 asks only for
        what is left after the tokens already streamed (they end its prompt)."""
        self.attempt += 1
        self.abandoned_ids = 0
        self.worker_request_id = self._attempt_id()
        self.order = TokenOrder(self.choices)
        self.ended_by = ""
        self.local_since = 0.0
        self.seen_snapshots, self.missed_rounds = {}, 0
        self.outcome = asyncio.get_running_loop().create_future()
        self.attempt_prompt_tokens = len(self.prompt) + (0 if self.sampling.is_group else len(self.generated))

    def _attempt_id(self) -> str:
        base = self.request_id if self.attempt == 1 else f"{self.request_id}.m{self.attempt}"
        return base if not self.abandoned_ids else f"{base}.r{self.abandoned_ids + 1}"

    def abandon_worker_id(self) -> None:
        """This attempt's id was sent in a reservation given up on: whatever its worker still does
        under it (a late lease or local take, the tokens of a local prefill) must not reach this
        record. The attempt goes on under a new id (the caller re-keys the RequestTable)."""
        self.abandoned_ids += 1
        self.worker_request_id = self._attempt_id()

    def attempt_request(self) -> tuple[list[int], SamplingParams]:
        """The prompt and sampling parameters this attempt sends."""
        s, done = self.sampling, self.generated
        if s.is_group or not done:  # a group runs again from its prompt: its seeds replay its tokens
            return self.prompt, s
        remaining = replace(
            s,
            max_tokens=s.max_tokens - len(done),
            min_tokens=max(0, s.min_tokens - len(done)),
            prompt_logprobs=None,  # (streamed with the first token already)
            # the constraint's matcher replays what was generated (the new prompt's tail)
            structured=None if s.structured is None else replace(s.structured, resumed_tokens=len(done)),
        )
        return self.prompt + done, remaining

    def end_attempt(self, error: BaseException | None = None) -> None:
        if self.outcome is not None and not self.outcome.done():
            if error is None:
                self.outcome.set_result(None)
            else:
                self.outcome.set_exception(error)

    # --- the token path ---------------------------------------------------------------------
    def accept(self, out: TokenOutput) -> None:
        """An output from a worker for this attempt."""
        if self.over:
            return
        if out.error is not None or out.finish_reason == "abort":  # the whole request, at once
            self._emit(out)
            self._finish(out.worker_id)
        elif self.order.arrive(out, self._emit):
            self._finish(out.worker_id)

    def _emit(self, out: TokenOutput) -> None:
        if self.state == "prefilling":  # its first output: the prefill worker is done with it
            self.state = "decoding"
            if self.on_first_output is not None:
                self.on_first_output(self, out)
        if self.group:
            if self.attempt > 1:  # a group run again: skip what its choices already streamed
                skipped = _skip_delivered(out, self.delivered)
                if skipped is None:
                    return
                out = skipped
            self.delivered[out.seq_index] = max(self.delivered.get(out.seq_index, 0), out.index + len(out.token_ids))
        else:
            if self.attempt > 1:  # to the client's numbering
                streamed_before = self.attempt_prompt_tokens - len(self.prompt)
                out = replace(out, request_id=self.request_id, index=out.index + streamed_before)
            elif out.request_id != self.request_id:  # (a worker id renewed after an abandoned reservation)
                out = replace(out, request_id=self.request_id)
            self.generated.extend(out.token_ids)
        self.stream.push(out)

    def _finish(self, worker_id: str) -> None:
        self.ended_by = worker_id
        self.state = "finished"
        self.stream.end()
        self.end_attempt()


def _skip_delivered(out: TokenOutput, delivered: dict[int, int]) -> TokenOutput | None:
    """A migrated group's output less what its choice already streamed (None: all of it was)."""
    skip = max(0, delivered.get(out.seq_index, 0) - out.index)
    if out.token_ids and skip >= len(out.token_ids) and out.finish_reason is None:
        return None
    if skip:
        out = replace(
            out,
            index=out.index + skip,
            token_ids=out.token_ids[skip:],
            logprobs=out.logprobs[skip:] if out.logprobs is not None else None,
        )
    return out


class RequestTable:
    """The records of the requests this gateway is running, by their workers' id."""

    def __init__(self) -> None:
        self._by_worker_id: dict[str, RequestRecord] = {}

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._by_worker_id.values()))

    def __len__(self) -> int:
        return len(self._by_worker_id)

    def get(self, worker_request_id: str) -> RequestRecord | None:
        return self._by_worker_id.get(worker_request_id)

    def find(self, request_id: str) -> RequestRecord | None:
        """By the gateway's request id, whatever its attempt."""
        rec = self._by_worker_id.get(request_id)
        if rec is None:
            rec = next((r for r in self._by_worker_id.values() if r.request_id == request_id), None)
        return rec

    def add(self, rec: RequestRecord) -> None:
        self._by_worker_id[rec.worker_request_id] = rec

    def abandon_worker_id(self, rec: RequestRecord) -> None:
        """`rec` goes on under a new worker id (RequestRecord.abandon_worker_id), re-keyed here:
        outputs and replies for the old one find nothing."""
        self.remove(rec)
        rec.abandon_worker_id()
        self.add(rec)

    def remove(self, rec: RequestRecord) -> None:
        if self._by_worker_id.get(rec.worker_request_id) is rec:
            del self._by_worker_id[rec.worker_request_id]
