"""Every control message that crosses a process boundary, as a tagged msgspec struct.

Encoding is msgpack through `encode`/`decode` below; decoding validates types and rejects
unknown tags, so a garbled or hostile frame raises `msgspec.ValidationError`/`DecodeError`
instead of producing an object. Nothing here is ever pickled.

Who sends what (G = gateway, P = prefill worker, D = decode worker, C = colocated worker):

    W -> G  Register, Heartbeat              membership (any worker kind); stats say when draining
    W -> G  Deregister                       leaving (drained, or its drain timed out: hand off)
    G -> W  Welcome                          gateway id, so W can address replies
    G -> W  Refused                          the gateway will not take W (why): W stops
    G -> D  ReserveRequest                   decode-first reservation (admission control)
    D -> G  ReserveReply                     lease (epoch, block ids, deadline) or refusal
    G -> P  PrefillRequest                   prompt + sampling + KV destination/lease
    G -> C  GenerateRequest                  whole request on one colocated worker
    P -> D  KvFrameHeader (+ raw frame)      one layer's KV for some blocks (kvtransfer/wire.py)
    P -> D  KvDone (on the KV stream)        all layers written; first token; D admits
    P -> D  KvRangeDone (a rank's KV stream) a TP prefill rank >= 1 sent all its heads' frames
    P -> D  KvRelease (on the KV stream)     P dropped the request: D reclaims the lease now
    P -> D  KvRenew (on the KV stream)       P still holds the request (queued or computing):
                                             extend its lease
    D -> G -> P  LeaseRenewed                the new deadline, once D has moved it (G forwards
                                             it to the prefill worker holding the request)
    P,D,C -> G  TokenOutput                  new tokens / finish / error for one request (the
                                             first one: the prompt's logprobs, when asked)
    D,C -> G  TokenOutputBatch               one step's TokenOutputs for one gateway, in one frame
    G -> P,D,C  Abort                        client went away or stop string hit
    W -> W  PrefixFetch (export socket)      a worker asks a peer for a prompt's leading blocks
                                             (hashes; the gateway's PrefillRequest.prefix_source
                                             names the peer); kvtransfer/prefix_exporter.py
    W -> W  KvFrameHeader (+ raw frame), PrefixFetchDone   the peer's answer on that socket:
                                             each layer's KV of the blocks it held, then how many
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from pdserve.protocol.sampling import SamplingParams

PROTOCOL_VERSION = 1

Role = Literal["prefill", "decode", "colocated"]
FinishReason = Literal["stop", "length", "abort", "error"]


# Each message restates frozen=True: msgspec inherits it, but type checkers (dataclass_transform)
# refuse a subclass that does not say so.
class _Msg(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # W3C traceparent, so a trace can follow gateway -> prefill -> transfer -> decode later.
    traceparent: str | None = None


class KvLayout(msgspec.Struct, frozen=True):
    """Shape of a worker's paged KV pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"
    kv_head_start: int = 0  # range of KV heads held (tensor parallelism re-slicing later)
    # A decode worker with a draft model (engine/spec/draft_model.py): the draft's fingerprint
    # (ModelConfig.fingerprint). A prefill worker with the same draft ships the draft's layers
    # in the same transfer, numbered after these `num_layers` (kvtransfer/wire.py); "" = none.
    draft_fingerprint: str = ""


class ShmPool(msgspec.Struct, frozen=True):
    """One rank's KV pool in shared memory: the worker's `KvLayout` restricted to KV heads
    [kv_head_start, kv_head_end) (a tensor-parallel decode worker advertises one per rank)."""

    name: str
    kv_head_start: int
    kv_head_end: int


class WorkerStats(msgspec.Struct, frozen=True):
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    num_running: int = 0
    num_waiting: int = 0
    steps: int = 0
    last_step_age_s: float = 0.0  # seconds since the engine loop last made progress
    dropped_frames: int = 0  # unauthenticated / undecodable / fenced-off frames dropped so far
    leases_active: int = 0  # decode: reservations waiting for their KV
    kv_blocks_quarantined: int = 0  # decode: blocks of ended leases held until their deadline
    lease_renewals: int = 0  # decode: leases extended so far for prefill workers still holding them
    kv_blocks_cached: int = 0  # of kv_blocks_free: blocks whose KV the prefix cache keeps until needed
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache so far
    prefix_hit_tokens: int = 0  # of them, found cached (not computed)
    kv_blocks_skipped: int = 0  # decode: prompt blocks found cached at reservation, so never transferred
    local_prefills: int = 0  # decode: requests whose short uncached rest it prefilled itself
    preemptions: int = 0  # sequences preempted (their KV dropped, recomputed later) so far
    seq_limit: int = 0  # its limit on running sequences now (adaptive: decode_node/aimd.py)
    draining: bool = False  # SIGTERM'd: takes no new requests, finishes those it has, then leaves
    # speculation (engine/spec/, vLLM's spec_decode counters, totals): verifications, draft
    # tokens proposed, of them accepted, and accepted at each draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # a draft model's prompt KV, in prompt tokens (engine/spec/draft_model.py DraftKvCounts):
    # shipped by the prefill worker, found in this worker's blocks, or rebuilt here by the draft
    spec_draft_kv_shipped_tokens: int = 0
    spec_draft_kv_cached_tokens: int = 0
    spec_draft_kv_rebuilt_tokens: int = 0
    # constrained decoding (engine/structured/, totals): rows masked, seconds filling + applying masks
    structured_mask_rows: int = 0
    structured_mask_seconds: float = 0.0
    # the prefix cache's disk tier (--kv-offload-dir; engine/kv_disk_tier.py): now, then totals
    kv_disk_blocks: int = 0  # blocks on disk
    kv_disk_bytes: int = 0
    kv_disk_capacity_bytes: int = 0  # 0: no disk tier
    kv_disk_hit_tokens: int = 0  # prompt tokens read back from disk instead of computed
    kv_disk_writes: int = 0  # blocks written
    kv_disk_write_bytes: int = 0
    kv_disk_reads: int = 0  # blocks read
    kv_disk_read_bytes: int = 0
    kv_disk_evictions: int = 0  # files removed to stay within the size
    kv_disk_corrupt: int = 0  # files that failed their check (deleted; their blocks computed)
    kv_disk_dropped_writes: int = 0  # blocks not written: the writer was too far behind
    # prefix blocks fetched from peer workers instead of computed (kvtransfer/prefix_fetcher.py), totals
    prefix_fetches: int = 0  # fetches asked of peers
    prefix_fetch_blocks: int = 0  # blocks that arrived, verified, and went into this worker's prefix cache
    prefix_fetch_bytes: int = 0  # their KV bytes
    prefix_fetch_failures: int = 0  # fetches that brought nothing (peer gone, timeout, refused, bad frames)
    prefix_exports: int = 0  # fetches this worker answered for peers
    prefix_export_blocks: int = 0  # blocks it sent them
    prefix_export_bytes: int = 0


class WorkerInfo(msgspec.Struct, frozen=True):
    worker_id: str
    role: Role
    control_addr: str  # where the gateway pushes requests to this worker
    host: str
    pid: int
    model_fingerprint: str  # architecture + shapes + dtype; pools must agree to exchange KV
    kv_layout: KvLayout
    kv_addr: str | None = None  # D only: where P pushes KV frames and KvDone
    shm_name: str | None = None  # D only: shared-memory KV pool P can map on the same host
    max_model_len: int = 0
    max_num_seqs: int = 0  # sequences it runs at once (decode: leases count too); 0 = unknown
    version: int = PROTOCOL_VERSION
    # D only, with shm_name: every rank's pool (rank 0's is shm_name); empty = one pool, all heads
    shm_pools: list[ShmPool] = msgspec.field(default_factory=list)
    # the GPU (its UUID) holding this worker's KV pool; "" on the CPU. A D's pool on a GPU is
    # shared by CUDA IPC (shm_name is then its handle, kvtransfer/cuda_ipc.py) with a P on that GPU
    kv_device: str = ""
    # where peers fetch prompt blocks this worker's prefix cache holds (kvtransfer/prefix_exporter.py);
    # None: it exports none
    export_addr: str | None = None


class Register(_Msg, kw_only=True, frozen=True):
    info: WorkerInfo
    # The gateway address this worker sent it to (as configured, e.g. a Service name): the
    # Welcome names it back, so the worker matches the reply whatever address the gateway bound.
    via: str = ""


class Deregister(_Msg, kw_only=True, frozen=True):
    """W -> G as a worker leaves: the gateway stops routing to it at once (no wait for missed
    heartbeats) and moves whatever it still held (a drain that timed out) to live workers."""

    worker_id: str
    reason: str = ""


class KvDigest(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's prefix-cache index for the gateway's KV-aware routing (gateway/kv_index.py):
    the block ids (`block_hashes.short_id`) registered and evicted since its previous digest, or,
    when `full`, every block id it holds. `seq` grows by one per digest, so a gap shows."""

    seq: int
    full: bool = False
    stored: list[int] = []
    removed: list[int] = []


class Heartbeat(_Msg, kw_only=True, frozen=True):
    worker_id: str
    stats: WorkerStats = WorkerStats()
    info: WorkerInfo | None = None  # lets a restarted gateway re-learn its workers
    kv: KvDigest | None = None  # what its prefix cache holds (workers with one)
    via: str = ""  # as Register.via
    # Reconciliation (gateway/reconcile.py): every request id the worker holds as its loop last
    # reported (a prefill worker's also for a while after it handed one over), None = not told;
    # of them, `leases` are a decode worker's reservations still waiting for their KV. `snapshot`
    # numbers the loop's reports: a heartbeat repeating an old one (the loop busy) tells nothing new.
    requests: list[str] | None = None
    leases: list[str] = []
    snapshot: int = 0


class Welcome(_Msg, kw_only=True, frozen=True):
    gateway_id: str
    inbox_addr: str  # the worker's configured address for this gateway (Register.via, echoed)


class Refused(_Msg, kw_only=True, frozen=True):
    """The gateway will not take this worker into its cluster: no worker it could pair with could
    exchange KV with it (its KV cache dtype differs from the pool's for the same model)."""

    gateway_id: str
    reason: str


class Lease(msgspec.Struct, frozen=True):
    """A decode worker's grant: P may write these blocks, fenced by `epoch`, until `deadline`.

    `deadline` is unix time (seconds) on D's clock; D quarantines the blocks until then even when
    the request is aborted, so a late writer can never touch blocks owned by someone else.
    """

    epoch: int
    block_ids: list[int]
    deadline: float
    # How long a renewal extends it: P renews a lease it still holds (queued or computing)
    # before half of this is left, so a request never fails on the lease clock while it waits.
    ttl_s: float = 0.0
    # D's blocks that already hold the prompt's leading blocks (its prefix cache, pinned for the
    # request): P sends nothing for them; `block_ids` are the prompt's blocks after these.
    prefix_block_ids: list[int] = []


class ReserveRequest(_Msg, kw_only=True, frozen=True):
    request_id: str
    gateway_id: str
    to_worker: str = ""  # the intended decode worker: a restarted worker on the same address ignores it
    num_prompt_tokens: int
    max_tokens: int
    # Chained hashes of the prompt's full blocks (protocol/block_hashes.py, salted with D's
    # model fingerprint and block size): D pins the leading ones it holds instead of receiving them.
    block_hashes: list[bytes] = []
    # Conditional disaggregation (gateway/prefill_placement.py): when at most this many of the
    # prompt's tokens are not in D's prefix cache, D prefills them itself (no prefill worker, no
    # transfer) unless another prompt waits for its engine; 0 = never. Needs the prompt and its
    # sampling parameters, sent only when the gateway offers it.
    local_prefill_max_tokens: int = 0
    local_prefill_always: bool = False  # take it even behind prompts waiting there (placement `local`)
    prompt_token_ids: list[int] = []
    sampling: SamplingParams | None = None
    num_seqs: int = 1  # sequences the request forks into on D (n, best_of, beam width): its seats


class ReserveReply(_Msg, kw_only=True, frozen=True):
    request_id: str
    worker_id: str
    lease: Lease | None = None  # None => refused
    reason: str = ""
    capacity: bool = False  # refused for lack of room now (seats, blocks): worth waiting for
    local: bool = False  # D took the whole request (prefills the short rest itself): no lease


class KvDestination(msgspec.Struct, frozen=True):
    worker_id: str
    kv_addr: str
    shm_name: str | None
    transport: Literal["zmq", "shm", "cuda-ipc"]
    lease: Lease
    layout: KvLayout  # the decode worker's pool (shm writers map it with this shape)
    shm_pools: list[ShmPool] = msgspec.field(default_factory=list)  # its rank pools (WorkerInfo's)


class PrefixSource(msgspec.Struct, frozen=True, kw_only=True):
    """A peer holding more of a prompt's leading blocks than the worker asked to prefill it, as the
    gateway's KV index says (a hint: the worker checks the hashes it gets). The worker fetches
    those blocks from it before computing the rest, when `num_blocks` exceed what it holds, and
    waits at most `timeout_s` for them (gateway/prefix_fetch_plan.py decides; then it computes)."""

    worker_id: str
    export_addr: str  # the peer's WorkerInfo.export_addr (from its registration, never a client's)
    num_blocks: int  # the prompt's leading full blocks the peer holds
    timeout_s: float


class PrefillRequest(_Msg, kw_only=True, frozen=True):
    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    dest: KvDestination
    arrival_time: float = 0.0
    prefix_source: PrefixSource | None = None  # fetch the prompt's leading blocks from this peer first


class GenerateRequest(_Msg, kw_only=True, frozen=True):
    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    arrival_time: float = 0.0


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A prompt's scores (SamplingParams.prompt_logprobs), from the logits of every prompt position
    but the last: entry i is about prompt token i + 1 given tokens 0..i (the first token has none).
    Columns, not one struct per token: a long prompt's scores stay one compact frame."""

    logprobs: list[float]  # [L - 1] each token's log-probability (fp32 log_softmax of the raw logits)
    ranks: list[int]  # [L - 1] its rank there (1: the most likely)
    top_ids: list[list[int]]  # [L - 1][K] the K most likely tokens, best first
    top_logprobs: list[list[float]]  # [L - 1][K]


class KvDone(_Msg, kw_only=True, frozen=True):
    """Sent by P on the KV stream after the last layer frame: D verifies and admits."""

    request_id: str
    gateway_id: str = ""
    lease_epoch: int
    prompt_token_ids: list[int] = []
    first_token: int = 0
    first_logprob: TokenLogprob | None = None
    sampling: SamplingParams = SamplingParams()
    num_layers: int
    kv_bytes: int = 0  # bytes of this stream's frames (all of them but other streams' KvRangeDone's)
    timings: dict[str, float] = {}
    # KvRangeDone markers of other KV streams (tensor-parallel prefill ranks sending their own
    # heads) D waits for before it admits: their frames may arrive after this message
    range_dones: int = 0
    # A sequence group (n > 1, best_of, beam search; engine/sequence_group.py): each member's
    # first token, or the first beam step's candidates. D forks from them and sends every token,
    # the first ones included (P sends the gateway nothing for a group).
    fork: list[TokenLogprob] = []
    # a group's prompt scores (SamplingParams.prompt_logprobs): D sends them on with its first output
    prompt_logprobs: PromptLogprobs | None = None


class PrefixFetch(_Msg, kw_only=True, frozen=True):
    """W -> a peer's export socket: send the KV of the leading run of these blocks you hold.
    The peer answers on the same connection: one KvFrameHeader + payload per layer (its target's
    layers, then a draft model's), `block_ids` being positions in `block_hashes`, then a
    PrefixFetchDone. `model_fingerprint` and `layout` (num_blocks aside) must be the peer's own,
    else it sends none."""

    fetch_id: str
    block_hashes: list[bytes]
    model_fingerprint: str
    layout: KvLayout
    payload_mac: bool = False  # put each payload's HMAC tag in its header (the asker checks them)


class PrefixFetchDone(_Msg, kw_only=True, frozen=True):
    """The peer's last message for a PrefixFetch: `num_blocks` leading blocks sent (0: none, `reason`)."""

    fetch_id: str
    num_blocks: int
    reason: str = ""


class KvRangeDone(_Msg, kw_only=True, frozen=True):
    """P's rank r (>= 1) -> D on its own KV stream after its last frame for a lease: its frames,
    KV heads [kv_head_start, kv_head_end), `kv_bytes` in all, are sent (KvDone counts these)."""

    request_id: str
    lease_epoch: int
    kv_head_start: int
    kv_head_end: int
    kv_bytes: int


class KvRelease(_Msg, kw_only=True, frozen=True):
    """P -> D on the KV stream: P has dropped this request (aborted, or it ended at its first
    token) and will never write its lease again. The stream is FIFO, so nothing of it can
    follow: D reclaims the leased blocks at once instead of waiting out the deadline."""

    request_id: str
    lease_epoch: int


class KvRenew(_Msg, kw_only=True, frozen=True):
    """P -> D on the KV stream: P still holds this request (queued behind other prompts, or
    computing it) and will write its lease. D extends an active lease of this epoch to
    now + ttl and says so with `LeaseRenewed`; an expired or revoked lease stays ended."""

    request_id: str
    lease_epoch: int


class LeaseRenewed(_Msg, kw_only=True, frozen=True):
    """D -> G -> P: D moved the lease's deadline (and quarantines its blocks until then if it is
    aborted). P writes by the new deadline only after it hears this, so P's idea of the
    deadline is never later than D's: the fencing of late shared-memory writes holds."""

    request_id: str
    worker_id: str  # the decode worker
    lease_epoch: int
    deadline: float


class TokenOutput(_Msg, kw_only=True, frozen=True):
    request_id: str
    worker_id: str = ""
    index: int = 0  # position of token_ids[0] in the output (the gateway reorders by it)
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    # TTFT breakdown (seconds, bytes) filled by P and D: prefill_queue, prefill_compute,
    # kv_transfer, kv_bytes, decode_admission ...
    timings: dict[str, float] = {}
    cached_tokens: int = 0  # first output: prompt tokens whose KV came from the prefix cache
    seq_index: int = 0  # the choice these tokens belong to (n > 1, best_of, beams); `index` counts per choice
    # the request's first output, when it asked for them (SamplingParams.prompt_logprobs)
    prompt_logprobs: PromptLogprobs | None = None


class TokenOutputBatch(_Msg, kw_only=True, frozen=True):
    """A step's outputs for every request of one gateway: one frame (one HMAC, one send, one
    receive) a step instead of one a request. Each entry is handled as if it came alone."""

    outputs: list[TokenOutput] = []


class Abort(_Msg, kw_only=True, frozen=True):
    request_id: str
    reason: str = ""
    # The gateway never sent the lease to any prefill worker (reservation it gave up on): nobody
    # can write it, so the decode worker reclaims the blocks at once instead of quarantining them.
    lease_unused: bool = False
    # One choice of a group whose choices stream (n > 1, best_of == n) ended at the gateway (a
    # stop string): only that member stops; the others run on. None: the whole request.
    seq_index: int | None = None


Message = Union[
    Register,
    Deregister,
    Heartbeat,
    Welcome,
    Refused,
    ReserveRequest,
    ReserveReply,
    PrefillRequest,
    GenerateRequest,
    KvDone,
    TokenOutput,
    TokenOutputBatch,
    Abort,
    LeaseRenewed,
]
# What each kind of inbox accepts: anything else is dropped and counted like a garbled frame.
ToGateway = Union[Register, Deregister, Heartbeat, ReserveReply, TokenOutput, TokenOutputBatch, LeaseRenewed]
ToWorker = Union[Welcome, Refused, ReserveRequest, PrefillRequest, GenerateRequest, Abort, LeaseRenewed]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_to_gateway = msgspec.msgpack.Decoder(ToGateway)
_to_worker = msgspec.msgpack.Decoder(ToWorker)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes | memoryview) -> Message:
    """Raises msgspec.DecodeError / ValidationError on anything that is not a known message."""
    return _decoder.decode(data)


def decode_to_gateway(data: bytes | memoryview) -> ToGateway:
    """A gateway inbox's decoder: only what workers send a gateway."""
    return _to_gateway.decode(data)


def decode_to_worker(data: bytes | memoryview) -> ToWorker:
    """A worker control inbox's decoder: only what gateways send workers."""
    return _to_worker.decode(data)
