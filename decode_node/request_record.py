"""One request's state on a decode or colocated worker: one record from the moment the worker
takes it (a lease granted, a local prefill, a GenerateRequest) until its last output, its abort
or its lease's expiry, dropped in one place (the worker's `_forget`). Its blocks are the lease
table's until its KV is admitted, then its engine sequence's (neither is duplicated here)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.messages import PromptLogprobs


@dataclass
class DecodeRecord:
    gateway_id: str  # where its outputs go
    # time.monotonic() its KV was admitted (decode) or it arrived (colocated): reported once, with
    # its first output (decode_admission_s / prefill_queue_s), then cleared
    waiting_since: float | None = None
    # a group's prompt logprobs (KvDone's: its prefill worker sent the gateway nothing), sent with
    # the first output that leaves here, then cleared
    prompt_logprobs: PromptLogprobs | None = None

    def take_wait(self, now: float) -> float | None:
        """Seconds since `waiting_since`, once (None after the first call)."""
        since, self.waiting_since = self.waiting_since, None
        return None if since is None else now - since
