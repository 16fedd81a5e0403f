"""Every request reconciled: a request this gateway holds that none of its workers names any more
ends, or runs again, instead of waiting forever.

Each worker's heartbeat carries the ids its loop holds (`Heartbeat.requests`, numbered by
`snapshot`; a decode worker's `leases` are those whose KV it still awaits; a prefill worker names
a request for HANDED_OVER_S after it handed it to its decode worker). The gateway looks at a
record in *rounds*: a round is complete when every worker the record watches
(`RequestRecord.watched`: the prefill worker while it prefills, the decode or colocated worker
until the end) has sent a snapshot newer than the one last looked at for it. A round in which
none of them names the request is a miss:

    worker snapshots  s7 (before it arrived)   s8          s9          s10
    names r?          -                        no  miss 1  no  miss 2  no  miss 3 -> lost
                      (seen at hold: ignored)  a round naming it resets the count

MISSED_ROUNDS misses in a row (with 0.5 s heartbeats, >= 1.5 s after the request reached them,
and the first snapshot seen is never counted) and its attempt ends with `RequestForgotten`. The
flows treat it as a lost worker: nothing streamed yet -> run again on a live pair (exact); tokens
streamed -> migrated with `--on-decode-failure migrate` (the prompt and the tokens so far
prefilled again, as after a death), else an SSE error event (or a 500 envelope before the first
byte); colocated -> the error. Each is counted in `pdserve_requests_reconciled_total{outcome}`.

A worker's loop that is busy (a long step) publishes no new snapshot, so its heartbeats complete
no round: a slow worker is never mistaken for one that forgot. A decode worker's lease does not
name a request still at its prefill worker (state `prefilling` with one): that one must. A worker
that does not tell (an older one: `requests` None) is never judged.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.request_record import RequestRecord, WorkerLost

MISSED_ROUNDS = 3  # rounds of fresh snapshots in a row that do not name a request: it is lost


class RequestForgotten(WorkerLost):
    """The workers a request depends on are alive but none of them holds it any more."""

    reason = "no longer holds the request"


def names(w: WorkerEntry, rec: RequestRecord) -> bool:
    """Whether `w`'s latest snapshot says it still works on (or waits for) `rec`'s attempt."""
    rid = rec.worker_request_id
    if w.held is None or rid not in w.held:
        return False
    # a lease waits for the prefill worker: while the request is there, that one must name it
    return not (rid in w.leased and w is rec.decode and rec.state == "prefilling" and rec.prefill is not None)


def forgotten(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """The records whose workers have not named them for MISSED_ROUNDS rounds in a row (each
    record's round bookkeeping is updated)."""
    lost = []
    for rec in records:
        if rec.over:
            continue
        workers = list(rec.watched())
        if not workers or any(w.held is None for w in workers):
            continue
        seen, complete = rec.seen_snapshots, True
        for w in workers:
            if w.worker_id not in seen:  # newly watched: only snapshots after this one count
                seen[w.worker_id] = w.snapshot
                complete = False
            elif w.snapshot <= seen[w.worker_id]:
                complete = False
        if not complete:
            continue
        for w in workers:
            seen[w.worker_id] = w.snapshot
        if any(names(w, rec) for w in workers):
            rec.missed_rounds = 0
            continue
        rec.missed_rounds += 1
        if rec.missed_rounds >= MISSED_ROUNDS:
            lost.append(rec)
    return lost
