"""`pdserve prefill|decode|colocated|gateway`: one role per process (pools scale separately).

A worker starts from one settings struct (runtime/worker_settings.py): built here from
its flags, with the machine-dependent defaults planned by cli/topology.py as for a worker alone
on its machine, or read from `--settings FILE` (what `pdserve serve` writes for its children).
"""

from __future__ import annotations

import argparse
import logging
import socket
from typing import Any

from pdserve.cli.engine_args import engine_config
from pdserve.cli.settings_flags import add_flags, from_flags
from pdserve.cli.topology import Topology, decode_idle_threads, decode_step_interval_ms, prefill_idle_lanes
from pdserve.env import settings
from pdserve.modelgen.default_model import resolve_model

log = logging.getLogger("pdserve")


def _setup(role: str, threads: int | None) -> None:
    logging.basicConfig(level=settings().log_level, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    if role != "gateway":
        from pdserve.worker_process import configure_worker_process

        configure_worker_process()  # heap tuning; KV writes into another worker's pool bypass the caches
    if threads:
        import torch

        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)


def _auth():
    from pdserve.protocol.auth import FrameAuth, load_cluster_secret

    return FrameAuth(load_cluster_secret())


SETTINGS_HELP = "start from this settings file (JSON, as `pdserve serve` writes), with no other flags"


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    """A `role` worker's flags: its settings struct's fields (cli/settings_flags.py)."""
    p.add_argument("--settings", default=None, metavar="FILE", help=SETTINGS_HELP)
    add_flags(p, settings_type(role))


# --- settings from flags (a worker alone on its machine) ------------------------------------
def worker_settings(args: argparse.Namespace, role: str, planned: dict[str, Any]) -> Any:
    return from_flags(
        settings_type(role),
        args,
        {"engine": engine_config(args, role), "gateways": _gateways(args, role), "host": _host(args), **planned},
    )


def prefill_settings(args: argparse.Namespace):
    topo = Topology.alone("prefill", args.threads)
    idle_lanes = 0 if args.tensor_parallel_size > 1 else prefill_idle_lanes(topo, args.idle_lanes)
    return worker_settings(args, "prefill", {"idle_lanes": idle_lanes})


def decode_settings(args: argparse.Namespace):
    topo = Topology.alone("decode", args.threads)
    return worker_settings(
        args,
        "decode",
        {
            "idle_threads": decode_idle_threads(topo, args.idle_threads),
            "step_interval_ms": decode_step_interval_ms(topo, 0, 0.0, args.step_interval_ms),
        },
    )


def colocated_settings(args: argparse.Namespace):
    return worker_settings(args, "colocated", {})


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
    worker = Worker(worker_settings, _auth())
    try:
        worker.run()
    finally:
        tracing.shutdown()
    return 1 if worker.refusal else 0


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
def gateway_options(args: argparse.Namespace, given: dict[str, Any] | None = None):
    from pdserve.gateway.options import GatewayOptions

    return from_flags(GatewayOptions, args, {"model": resolve_model(args.model), **(given or {})})


def read_gateway_options(path: str):
    import msgspec

    from pdserve.gateway.options import GatewayOptions

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
