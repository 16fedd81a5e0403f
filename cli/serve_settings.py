"""`pdserve serve`'s own settings: the pools it starts on this machine and how they share its
cores. Its other flags are its children's (EngineConfig, GatewayOptions, DecodeSettings fields);
cli/topology.py plans what is left unsaid, cli/serve.py writes each child's settings file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pdserve.flag import Flag

KvTransport = Literal["auto", "shm", "cuda-ipc", "zmq-ipc", "zmq-tcp"]
DECODE_FLAGS = ("lease_ttl_s", "tpot_target_ms", "min_num_seqs", "kv_payload_mac")  # DecodeSettings' serve takes
# GatewayOptions' fields serve sets itself (or takes from the engine flags: --model, --max-model-len)
GATEWAY_FIELDS_SET = (
    "model",
    "worker_bind",
    "worker_advertise",
    "allow_wildcard_bind",
    "kv_transport",
    "max_model_len",
)


@dataclass(frozen=True)
class ServeSettings:
    prefill_workers: Annotated[int, Flag("prefill worker processes")] = 1
    decode_workers: Annotated[int, Flag("decode worker processes")] = 1
    colocated: Annotated[bool, Flag("one worker doing both phases (baseline)")] = False
    threads: Annotated[int | None, Flag("torch threads per worker (default: cores / workers)")] = None
    prefill_threads: Annotated[
        int | None, Flag("torch threads per prefill worker (default: --threads, else cores / workers)")
    ] = None
    decode_threads: Annotated[
        int | None, Flag("torch threads per decode worker (default: --threads, else cores / workers)")
    ] = None
    prefill_tensor_parallel_size: Annotated[
        int | None,
        Flag(
            "tensor-parallel degree of each prefill worker (default: --tensor-parallel-size); the pools' degrees "
            "may differ: KV heads are re-sliced on the way (kvtransfer/head_ranges.py)"
        ),
    ] = None
    decode_tensor_parallel_size: Annotated[
        int | None,
        Flag(
            "tensor-parallel degree of each decode worker (default: --tensor-parallel-size); the pools' degrees "
            "may differ: KV heads are re-sliced on the way (kvtransfer/head_ranges.py)"
        ),
    ] = None
    decode_idle_threads: Annotated[
        int | None,
        Flag(
            "torch threads per decode worker while no prefill for it is in flight: it borrows the prefill cores "
            "then (default: cores / decode workers; = --decode-threads: off)"
        ),
    ] = None
    kv_transport: Annotated[
        KvTransport,
        Flag(
            "how KV moves to the decode workers: auto (shared memory; CUDA IPC between workers on one GPU), "
            "shm, cuda-ipc, zmq-ipc, zmq-tcp"
        ),
    ] = "auto"
    prefill_nice: Annotated[
        int,
        Flag(
            "lower the prefill workers' CPU priority by this much, so that on shared cores a decode step never "
            "waits behind a prefill (use with --prefill-threads = all cores)"
        ),
    ] = 0
    prefill_idle_lanes: Annotated[
        int | None,
        Flag(
            "extra lanes per prefill worker at the kernel's idle priority (SCHED_IDLE): they run prefill steps on "
            "the cycles the decode pool leaves idle, and a decode step preempts them at once (default: the cores "
            "outside the prefill pool, in --prefill-threads lanes)"
        ),
    ] = None
    decode_step_interval_ms: Annotated[
        float | None,
        Flag(
            "while prompts for a decode worker queue behind a prefill, it spaces its steps, up to this far apart "
            "at a queue of 2 prompts: the gaps go to prefill and its batch grows, spending TPOT slack on TTFT and "
            "capacity (0: back to back; default: 0.6 x --tpot-slo-ms when prefill can use the decode cores, "
            "else 0)"
        ),
    ] = None
    prefill_max_num_batched_tokens: Annotated[
        int | None,
        Flag(
            "token budget of a prefill (or --colocated) worker's step (default: 512 on CPU, where a smaller step "
            "gives a queue's first prompts their first token sooner; else --max-num-batched-tokens)"
        ),
    ] = None
    prefix_sharing: Annotated[
        bool,
        Flag(
            "prefill workers neither export prompt blocks to each other nor fetch those a peer holds (which the "
            "gateway suggests when fetching costs less than computing)",
            name="--no-prefix-sharing",
        ),
    ] = True
