"""`pdserve prefill|decode|colocated|gateway`: one role per process (pools scale separately).

A worker starts from one settings struct (runtime/worker_settings.py): built here from
its flags, with the machine-dependent defaults planned by cli/topology.py as for a worker alone
on its machine, or read from `--settings FILE` (what `pdserve serve` writes for its children).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from pdserve.cli.engine_args import add_engine_args, engine_config, resolve_model
from pdserve.cli.topology import Topology, decode_idle_threads, decode_step_interval_ms, prefill_idle_lanes
from pdserve.env import settings

log = logging.getLogger("pdserve")


def _setup(role: str, threads: int | None) -> None:
    logging.basicConfig(level=settings().log_level, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
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
    p.add_argument(
        "--settings",
        default=None,
        metavar="FILE",
        help="start from this settings file (JSON, as `pdserve serve` writes), with no other flags",
    )
    p.add_argument(
        "--gateway",
        action="append",
        required=True,
        help="the gateway to join (repeatable): its worker plane, e.g. tcp://10.0.0.5:7100, or its "
        "HTTP URL, e.g. http://10.0.0.5:8000 (the worker asks it for the worker plane, proving it "
        "holds the cluster secret)",
    )
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="this worker's control inbox")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM take no new requests and finish those held, for at most this many seconds; "
        "then hand the rest off to live workers and exit",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces (OTLP/HTTP); needs pdserve[tracing]",
    )
    p.add_argument(
        "--health-bind",
        default=None,
        metavar="HOST:PORT",
        help="serve /health/live and /health/ready here (probes); default: none",
    )
    p.add_argument(
        "--advertise-host", default=None, help="host name peers use to decide on shared memory (default: this host)"
    )


def add_kv_args(p: argparse.ArgumentParser, role: str) -> None:
    """KV data-path flags of prefill and decode workers."""
    p.add_argument(
        "--kv-payload-mac",
        default="auto",
        choices=["auto", "on", "off"],
        help="HMAC over every KV payload's bytes, checked before they land in KV blocks: "
        "auto = on for tcp:// links left unencrypted (PDSERVE_PLANE_ENCRYPTION=off; CURVE authenticates the "
        "encrypted ones), off for ipc:// and shared memory (same host)",
    )
    if role == "decode":
        p.add_argument(
            "--kv-advertise",
            default=None,
            help="KV address sent in the registration for prefill workers to connect to "
            "(default: the bound --kv-bind address)",
        )


# --- settings from flags (a worker alone on its machine) ------------------------------------
def prefill_settings(args: argparse.Namespace):
    from pdserve.prefill_node.settings import PrefillSettings

    topo = Topology.alone("prefill", args.threads)
    return PrefillSettings(
        engine=engine_config(args, "prefill"),
        control_bind=args.bind,
        gateways=_gateways(args, "prefill"),
        host=_host(args),
        threads=args.threads,
        drain_timeout_s=args.drain_timeout,
        health_bind=args.health_bind,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        kv_payload_mac=args.kv_payload_mac,
        lanes=args.lanes,
        idle_lanes=0 if args.tensor_parallel_size > 1 else prefill_idle_lanes(topo, args.idle_lanes),
    )


def decode_settings(args: argparse.Namespace):
    from pdserve.decode_node.settings import DecodeSettings

    topo = Topology.alone("decode", args.threads)
    return DecodeSettings(
        engine=engine_config(args, "decode"),
        control_bind=args.bind,
        gateways=_gateways(args, "decode"),
        host=_host(args),
        threads=args.threads,
        drain_timeout_s=args.drain_timeout,
        health_bind=args.health_bind,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        kv_bind=args.kv_bind,
        kv_advertise=args.kv_advertise,
        shared_memory=not args.no_shm,
        lease_ttl_s=args.lease_ttl,
        kv_payload_mac=args.kv_payload_mac,
        idle_threads=decode_idle_threads(topo, args.idle_threads),
        step_interval_ms=decode_step_interval_ms(topo, 0, 0.0, args.step_interval_ms),
        min_num_seqs=args.min_num_seqs,
        tpot_target_ms=args.tpot_slo_ms,
    )


def colocated_settings(args: argparse.Namespace):
    from pdserve.decode_node.settings import ColocatedSettings

    return ColocatedSettings(
        engine=engine_config(args, "colocated"),
        control_bind=args.bind,
        gateways=_gateways(args, "colocated"),
        host=_host(args),
        threads=args.threads,
        drain_timeout_s=args.drain_timeout,
        health_bind=args.health_bind,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


# --- running a role -------------------------------------------------------------------------
def run_worker(role: str, worker_settings) -> int:
    """Start the `role` worker from its settings and run it until SIGTERM."""
    from pdserve import tracing

    _setup(role, worker_settings.threads)
    try:
        tracing.setup_tracing(f"pdserve-{role}", worker_settings.otlp_traces_endpoint)
    except tracing.TracingUnavailable as e:
        raise SystemExit(f"pdserve {role}: {e}") from None
    if role == "prefill":
        from pdserve.prefill_node.worker import PrefillWorker as Worker
    elif role == "decode":
        from pdserve.decode_node.worker import DecodeWorker as Worker  # type: ignore[assignment]
    else:
        from pdserve.decode_node.colocated import ColocatedWorker as Worker  # type: ignore[assignment]
    try:
        Worker(worker_settings, _auth()).run()
    finally:
        tracing.shutdown()
    return 0


def settings_type(role: str) -> type:
    if role == "prefill":
        from pdserve.prefill_node.settings import PrefillSettings

        return PrefillSettings
    from pdserve.decode_node.settings import ColocatedSettings, DecodeSettings

    return {"decode": DecodeSettings, "colocated": ColocatedSettings}[role]


def run_from_file(role: str, path: str) -> int:
    from pdserve.runtime.worker_settings import WorkerSettings, read_settings

    if role == "gateway":
        return _run_gateway(read_gateway_options(path))
    try:
        worker_settings: WorkerSettings = read_settings(path, settings_type(role))
    except ValueError as e:
        raise SystemExit(f"pdserve {role}: {e}") from None
    return run_worker(role, worker_settings)


def run_prefill(args: argparse.Namespace) -> int:
    return run_worker("prefill", prefill_settings(args))


def run_decode(args: argparse.Namespace) -> int:
    return run_worker("decode", decode_settings(args))


def run_colocated(args: argparse.Namespace) -> int:
    return run_worker("colocated", colocated_settings(args))


# --- the gateway ----------------------------------------------------------------------------
def gateway_options(args: argparse.Namespace):
    from pdserve.gateway.admission import QueueLimits
    from pdserve.gateway.server import GatewayOptions

    return GatewayOptions(
        model=resolve_model(args.model),
        host=args.host,
        port=args.port,
        worker_bind=args.worker_bind,
        worker_advertise=args.worker_advertise,
        allow_wildcard_bind=args.allow_wildcard_bind,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        kv_transport=args.kv_transport,
        api_key=args.api_key,
        api_keys_file=os.path.abspath(args.api_keys_file) if args.api_keys_file else None,
        ssl_certfile=os.path.abspath(args.ssl_certfile) if args.ssl_certfile else None,
        ssl_keyfile=os.path.abspath(args.ssl_keyfile) if args.ssl_keyfile else None,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        on_decode_failure=args.on_decode_failure,
        request_timeout_s=args.request_timeout,
        stream_write_timeout_s=args.stream_write_timeout,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        queue_limits=QueueLimits(
            max_requests=args.max_queued_requests, max_tokens=args.max_queued_tokens, max_wait_s=args.max_queue_wait
        ),
        stuck_after_s=args.stuck_after,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        router=args.router,
        prefill_placement=args.prefill_placement,
    )


def read_gateway_options(path: str):
    import msgspec

    from pdserve.gateway.server import GatewayOptions

    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=GatewayOptions)
    except (OSError, msgspec.DecodeError) as e:
        raise SystemExit(f"pdserve gateway: settings {path}: {e}") from None


def run_gateway(args: argparse.Namespace) -> int:
    return _run_gateway(gateway_options(args))


def _run_gateway(options) -> int:
    import dataclasses

    _setup("gateway", None)
    from pdserve.gateway.server import serve_gateway

    serve_gateway(dataclasses.replace(options, api_key=options.api_key or settings().api_key), _auth())
    return 0


def _gateways(args, role: str) -> list[str]:
    """--gateway values, an http(s):// URL turned into that gateway's worker plane (join_client)."""
    from pdserve.runtime.join_client import JoinError, is_http_gateway, join_gateway

    out = []
    for addr in args.gateway:
        if is_http_gateway(addr):
            _setup(role, None)  # (logging, for the join's progress)
            try:
                addr = join_gateway(addr, _auth(), role, _host(args))
            except JoinError as e:
                raise SystemExit(f"pdserve {role}: {e}") from None
        out.append(addr)
    return out


def _host(args) -> str:
    return args.advertise_host or socket.gethostname()
