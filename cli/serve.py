"""`pdserve serve`: gateway + N prefill + M decode workers (or one colocated) on this machine.

Each role is its own OS process (`python -m pdserve.cli <role> --settings FILE`: one typed
struct per process, planned for this machine by cli/topology.py). Control sockets are IPC
files in a private 0700 runtime directory. The children share the cluster secret the user gave
(PDSERVE_CLUSTER_SECRET, or PDSERVE_CLUSTER_SECRET_FILE), so workers started by hand with it
can join; without one, a fresh secret goes to them through the environment. A worker that dies
is restarted; Ctrl-C / SIGTERM stops them all.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pdserve.cli import roles
from pdserve.cli.engine_args import engine_config
from pdserve.cli.serve_settings import ServeSettings
from pdserve.cli.settings_flags import from_flags
from pdserve.cli.topology import (
    Topology,
    cpu_count,
    decode_idle_threads,
    decode_step_interval_ms,
    prefill_idle_lanes,
)
from pdserve.env import settings
from pdserve.gateway.tenants import KeysFileError, read_keys_file
from pdserve.gateway.tls import check_tls_files
from pdserve.modelgen.default_model import resolve_model
from pdserve.protocol.auth import ENV_SECRET, ClusterSecretError, generate_cluster_secret, load_cluster_secret

log = logging.getLogger("pdserve.serve")

QUICK_EXIT_S = 60.0  # a worker that exits this soon after starting, MAX_QUICK_EXITS times in a row,
MAX_QUICK_EXITS = 3  # is not restarted again: `serve` stops with an error instead of looping


@dataclass
class Child:
    name: str
    argv: list[str]
    settings: Any = None  # the struct its --settings file holds
    proc: subprocess.Popen | None = None
    restarts: int = 0
    nice: int = 0  # added to the process's niceness (lower CPU priority) when > 0
    started_at: float = 0.0
    quick_exits: int = 0  # exits in a row within QUICK_EXIT_S of starting (a crash loop)

    def start(self, env: dict[str, str]) -> None:
        nice = self.nice

        def in_child() -> None:
            # Ctrl-C reaches the whole process group; the supervisor alone answers it (the
            # gateway drains, then the workers get SIGTERM). An ignored signal stays ignored
            # across exec, and Python then installs no KeyboardInterrupt handler.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if nice > 0:
                os.nice(nice)

        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=in_child)
        self.started_at = time.monotonic()


def topology(pools: ServeSettings) -> Topology:
    return Topology(
        cpus=cpu_count(),
        prefill_workers=pools.prefill_workers,
        decode_workers=pools.decode_workers,
        colocated=pools.colocated,
        threads=pools.threads,
        prefill_threads=pools.prefill_threads,
        decode_threads=pools.decode_threads,
    )


def pool_args(args: argparse.Namespace, degree: int | None) -> argparse.Namespace:
    """The flags as one pool's workers take them: its own tensor-parallel degree, if given."""
    return argparse.Namespace(**{**vars(args), "tensor_parallel_size": degree or args.tensor_parallel_size})


def plan_children(args: argparse.Namespace, run_dir: str) -> list[Child]:
    """Every process's settings, planned for this machine (cli/topology.py), each started as
    `python -m pdserve.cli ROLE --settings RUN_DIR/NAME.json`. Each struct is made from the flags
    (cli/settings_flags.py), with what serve plans given."""

    def child(name: str, role: str, settings: Any, nice: int = 0) -> Child:
        path = Path(run_dir) / f"{name}.json"
        path.write_bytes(msgspec.json.format(msgspec.json.encode(settings)))
        return Child(name, [sys.executable, "-m", "pdserve.cli", role, "--settings", str(path)], settings, nice=nice)

    pools = from_flags(ServeSettings, args)
    topo = topology(pools)
    gw_inbox = f"ipc://{run_dir}/gateway.sock"
    gw_transport = {"auto": "auto", "shm": "shm", "cuda-ipc": "cuda-ipc", "zmq-ipc": "zmq", "zmq-tcp": "zmq"}[
        pools.kv_transport
    ]
    # the key travels in the environment, not in a file
    gw_given = {"worker_bind": gw_inbox, "kv_transport": gw_transport, "api_key": None}
    children = [child("gateway", "gateway", roles.gateway_options(args, gw_given))]
    host = socket.gethostname()

    def worker(name: str, role: str, given: dict[str, Any]) -> Any:
        common = {"control_bind": f"ipc://{run_dir}/{name}.sock", "gateways": [gw_inbox], "host": host}
        return from_flags(roles.settings_type(role), args, {**common, **given})

    if pools.colocated:
        if pools.prefill_tensor_parallel_size or pools.decode_tensor_parallel_size:
            raise SystemExit(
                "pdserve serve: --prefill-/--decode-tensor-parallel-size set the 1P1D pools' degrees; "
                "a colocated worker takes --tensor-parallel-size"
            )
        engine = engine_config(args, "colocated", pools.prefill_max_num_batched_tokens)
        settings = worker("colocated-0", "colocated", {"engine": engine, "threads": topo.share})
        return [*children, child("colocated-0", "colocated", settings)]
    prefill_args = pool_args(args, pools.prefill_tensor_parallel_size)
    decode_args = pool_args(args, pools.decode_tensor_parallel_size)
    idle_lanes = prefill_idle_lanes(topo, pools.prefill_idle_lanes)
    if prefill_args.tensor_parallel_size > 1:
        if pools.prefill_idle_lanes:
            raise SystemExit("pdserve serve: a tensor-parallel prefill worker runs one lane: drop --prefill-idle-lanes")
        idle_lanes = 0  # its ranks step in lockstep: one step at a time
    for i in range(pools.prefill_workers):
        name = f"prefill-{i}"
        engine = engine_config(prefill_args, "prefill", pools.prefill_max_num_batched_tokens)
        export = "tcp://127.0.0.1:0" if pools.kv_transport == "zmq-tcp" else f"ipc://{run_dir}/{name}-export.sock"
        planned = {
            "engine": engine,
            "threads": topo.prefill_share,
            "idle_lanes": idle_lanes,
            "prefix_export_bind": export,
            "prefix_sharing": pools.prefix_sharing,
        }
        settings = worker(name, "prefill", planned)
        children.append(child(name, "prefill", settings, nice=pools.prefill_nice))
    for i in range(pools.decode_workers):
        name = f"decode-{i}"
        planned = {
            "engine": engine_config(decode_args, "decode"),
            "threads": topo.decode_share,
            "kv_bind": "tcp://127.0.0.1:0" if pools.kv_transport == "zmq-tcp" else f"ipc://{run_dir}/{name}-kv.sock",
            "shared_memory": pools.kv_transport not in ("zmq-ipc", "zmq-tcp"),
            "idle_threads": decode_idle_threads(topo, pools.decode_idle_threads),
            "step_interval_ms": decode_step_interval_ms(
                topo, idle_lanes, args.tpot_slo_ms, pools.decode_step_interval_ms
            ),
        }
        children.append(child(name, "decode", worker(name, "decode", planned)))
    return children


def children_env(api_key: str | None) -> dict[str, str]:
    """The environment every child starts with: this one, the API key, and the cluster secret.
    A secret the user gave is checked now and passed on as given (the variable, or the file's
    name); only when none is given is a fresh one made."""
    env = dict(os.environ)
    given = settings()
    if given.cluster_secret or given.cluster_secret_file:
        try:
            load_cluster_secret()
        except ClusterSecretError as e:
            raise SystemExit(f"pdserve serve: {e}") from None
        log.info("cluster secret: the one given (workers started with it may join)")
    else:
        env[ENV_SECRET] = generate_cluster_secret().hex()
        log.info("cluster secret: a fresh one (set %s to let other workers join)", ENV_SECRET)
    if api_key:
        env["PDSERVE_API_KEY"] = api_key
    return env


def _own_tls_probe() -> ssl.SSLContext:
    """For polling our own gateway child over HTTPS on this host: its certificate is the user's
    (possibly self-signed, named for another host), so it is not verified for this probe."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def wait_healthy(
    url: str, children: list[Child], timeout_s: float, stopping: Callable[[], bool] = lambda: False
) -> bool:
    deadline = time.monotonic() + timeout_s
    tls = _own_tls_probe() if url.startswith("https://") else None
    while time.monotonic() < deadline and not stopping():
        if any(c.proc is not None and c.proc.poll() is not None for c in children):
            return False
        try:
            with urllib.request.urlopen(url, timeout=1, context=tls) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s: %(message)s")
    if args.api_keys_file:  # a bad keys file fails here, before any child starts
        try:
            read_keys_file(args.api_keys_file)
        except KeysFileError as e:
            raise SystemExit(f"pdserve serve: --api-keys-file: {e}") from None
    check_tls_files(args.ssl_certfile, args.ssl_keyfile)  # before any child starts
    env = children_env(args.api_key)
    args.model = resolve_model(args.model)  # make the default model once, before the children
    run_dir = tempfile.mkdtemp(prefix="pdserve-")
    os.chmod(run_dir, 0o700)
    children = plan_children(args, run_dir)
    stopping = False

    def stop(*_):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        # The gateway stops taking requests now (uvicorn closes its listener and drains the
        # in-flight ones), not only at the supervisor's next tick.
        gateway = children[0]
        if gateway.proc is not None and gateway.proc.poll() is None:
            gateway.proc.terminate()

    stopped_by = []  # the signal that ended it, for the one closing line

    def on_signal(signum, _frame):
        stopped_by.append(signal.Signals(signum).name)
        stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for c in children:
            c.start(env)
        url = f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}"
        if wait_healthy(f"{url}/health", children, timeout_s=300, stopping=lambda: stopping):
            print(f"pdserve ready: {url}/v1 (model {args.model})", flush=True)
        elif not stopping:
            log.error("the server did not become healthy; see the logs above")
        while not stopping:
            for c in children:
                if c.proc is not None and c.proc.poll() is not None and not stopping:
                    if c.name == "gateway":
                        log.error("gateway exited with %s; stopping", c.proc.returncode)
                        return 1
                    quick = time.monotonic() - c.started_at < QUICK_EXIT_S
                    c.quick_exits = c.quick_exits + 1 if quick else 0
                    if c.quick_exits >= MAX_QUICK_EXITS:  # it fails at start (a bad flag, no memory): stop
                        log.error(
                            "%s exited with %s %d times in a row within %.0f s of starting; stopping "
                            "(its error is above)",
                            c.name,
                            c.proc.returncode,
                            c.quick_exits,
                            QUICK_EXIT_S,
                        )
                        return 1
                    c.restarts += 1
                    log.warning("%s exited with %s; restarting (restart #%d)", c.name, c.proc.returncode, c.restarts)
                    c.start(env)
            time.sleep(0.2)
        return 0
    finally:
        # Drain: the gateway stops taking requests and lets in-flight ones finish (uvicorn's
        # graceful shutdown) while the workers still run; then the workers stop.
        _stop_all([c for c in children if c.name == "gateway"], timeout_s=30)
        _stop_all([c for c in children if c.name != "gateway"], timeout_s=10)
        shutil.rmtree(run_dir, ignore_errors=True)
        if stopped_by:
            print(
                f"pdserve: stopped on {stopped_by[0]}; all {len(children)} processes exited",
                file=sys.stderr,
                flush=True,
            )


def _stop_all(children: list[Child], timeout_s: float) -> None:
    for c in children:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + timeout_s
    for c in children:
        if c.proc is not None:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
