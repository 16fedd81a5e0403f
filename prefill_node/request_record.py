"""One disaggregated request's state on a prefill worker, from its PrefillRequest until its
KvDone (or release) is sent: one record, created in `_on_prefill`, dropped in `_forget`."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kvtransfer.sender import KvSender
from pdserve.protocol.messages import KvDestination, KvDone, PrefillRequest, PromptLogprobs, TokenLogprob


@dataclass
class TransferStats:
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None  # set when a send failed: the request is failed, the step goes on
    rank_streams: int = 0  # other tensor-parallel ranks sending its heads (KvDone's range_dones)


@dataclass
class PrefillRecord:
    req: PrefillRequest
    sender: KvSender  # to its decode worker (shared by every request going there)
    received: float  # time.monotonic()
    first_scheduled: float | None = None
    renew_sent: float = 0.0  # time.time() of the last KvRenew for its lease
    transfer: TransferStats = field(default_factory=TransferStats)
    ships_draft: bool = False  # the draft model's layers go too (D runs the same draft)
    # its prompt's leading blocks fetched from a peer before it was queued (prefix_sharing.py)
    fetched_blocks: int = 0
    fetch_bytes: int = 0
    fetch_s: float = 0.0
    dest: KvDestination = field(init=False)  # the lease as last renewed (same epoch, later deadline)

    def __post_init__(self) -> None:
        self.dest = self.req.dest

    def kv_done(
        self,
        first_token: int,
        first_logprob: TokenLogprob | None,
        num_layers: int,
        timings: dict[str, float],
        fork: list[TokenLogprob] | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> KvDone:
        """The message that hands the request (its KV, first token and sampling) to its decoder
        (a group's prompt logprobs too: the decoder sends its outputs to the gateway)."""
        req = self.req
        return KvDone(
            request_id=req.request_id,
            gateway_id=req.gateway_id,
            lease_epoch=self.dest.lease.epoch,
            prompt_token_ids=req.prompt_token_ids,
            first_token=first_token,
            first_logprob=first_logprob,
            sampling=req.sampling,
            num_layers=num_layers,
            kv_bytes=self.transfer.bytes,
            range_dones=self.transfer.rank_streams,
            timings=timings,
            fork=fork or [],
            prompt_logprobs=prompt_logprobs,
            traceparent=req.traceparent,
        )
