"""`pdserve prefill|decode|colocated|gateway`: one role per process (pools scale separately)."""
from __future__ import annotations

import argparse
import logging

from pdserve.cli.engine_args import add_engine_args, engine_config, resolve_model
from pdserve.env import settings

log = logging.getLogger("pdserve")


def _setup(role: str, threads: int | None) -> None:
    logging.basicConfig(level=settings().log_level,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    if role != "gateway":
        from pdserve.kvtransfer.malloc_tuning import keep_large_allocations_in_heap
        keep_large_allocations_in_heap()
    if threads:
        import torch
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)


def _auth():
    from pdserve.protocol.auth import FrameAuth, load_cluster_secret
    return FrameAuth(load_cluster_secret())


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--gateway", action="append", required=True,
                   help="gateway inbox address, e.g. tcp://10.0.0.5:7100 (repeatable)")
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="this worker's control inbox")
    p.add_argument("--advertise-host", default=None,
                   help="host name peers use to decide on shared memory (default: this host)")


def add_kv_args(p: argparse.ArgumentParser, role: str) -> None:
    """KV data-path flags of prefill and decode workers."""
    p.add_argument("--kv-payload-mac", default="auto", choices=["auto", "on", "off"],
                   help="HMAC over every KV payload's bytes, checked before they land in KV blocks: "
                        "auto = on for tcp://, off for ipc:// and shared memory (same host)")
    if role == "decode":
        p.add_argument("--kv-advertise", default=None,
                       help="KV address sent in the registration for prefill workers to connect to "
                            "(default: the bound --kv-bind address)")


def run_prefill(args: argparse.Namespace) -> int:
    _setup("prefill", args.threads)
    from pdserve.prefill_node.worker import PrefillWorker
    PrefillWorker(engine_config(args), _auth(), args.bind, args.gateway, host=_host(args),
                  kv_payload_mac=args.kv_payload_mac, lanes=args.lanes, idle_lanes=args.idle_lanes).run()
    return 0


def run_decode(args: argparse.Namespace) -> int:
    _setup("decode", args.threads)
    from pdserve.decode_node.worker import DecodeWorker
    DecodeWorker(engine_config(args), _auth(), args.bind, args.kv_bind, args.gateway,
                 shared_memory=not args.no_shm, host=_host(args), lease_ttl_s=args.lease_ttl,
                 kv_advertise=args.kv_advertise, kv_payload_mac=args.kv_payload_mac,
                 idle_threads=args.idle_threads, step_interval_ms=args.step_interval_ms).run()
    return 0


def run_colocated(args: argparse.Namespace) -> int:
    _setup("colocated", args.threads)
    from pdserve.decode_node.colocated import ColocatedWorker
    ColocatedWorker(engine_config(args), _auth(), args.bind, args.gateway, host=_host(args)).run()
    return 0


def run_gateway(args: argparse.Namespace) -> int:
    _setup("gateway", None)
    from pdserve.gateway.admission import QueueLimits
    from pdserve.gateway.server import GatewayOptions, serve_gateway
    serve_gateway(GatewayOptions(model=resolve_model(args.model), host=args.host, port=args.port,
                                 worker_bind=args.worker_bind, kv_transport=args.kv_transport,
                                 api_key=args.api_key or settings().api_key,
                                 max_model_len=args.max_model_len, served_model_name=args.served_model_name,
                                 on_decode_failure=args.on_decode_failure,
                                 request_timeout_s=args.request_timeout,
                                 stream_write_timeout_s=args.stream_write_timeout,
                                 chat_template=args.chat_template,
                                 queue_limits=QueueLimits(max_requests=args.max_queued_requests,
                                                          max_tokens=args.max_queued_tokens,
                                                          max_wait_s=args.max_queue_wait),
                                 stuck_after_s=args.stuck_after),
                  _auth())
    return 0


def _host(args) -> str:
    import socket
    return args.advertise_host or socket.gethostname()
