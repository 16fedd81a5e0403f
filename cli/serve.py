"""`pdserve serve`: gateway + N prefill + M decode workers (or one colocated) on this machine.

Each role is its own OS process (`python -m pdserve.cli <role> ...`). Control sockets are IPC
files in a private 0700 runtime directory; a fresh cluster secret is handed to the children
through the environment. A worker that dies is restarted; Ctrl-C / SIGTERM stops them all.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cli.engine_args import engine_args_to_argv, resolve_model

log = logging.getLogger("pdserve.serve")


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    nice: int = 0  # added to the process's niceness (lower CPU priority) when > 0

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


def prefill_budget(args: argparse.Namespace) -> int:
    """Token budget of a prefill (or colocated) worker's step. On CPU, 512 tokens a step: matmuls
    of 512 rows already run at full speed, and a queue's first prompts get their first token
    without waiting for the prompts batched behind them (p99 TTFT 8.2 -> 4.3 s at 1 req/s in the
    1P1D SLO sweep); a colocated worker's decodes wait behind at most 512 prompt tokens."""
    if args.prefill_max_num_batched_tokens:
        return args.prefill_max_num_batched_tokens
    if args.device == "cpu":
        return min(512, args.max_num_batched_tokens)
    return args.max_num_batched_tokens


def prefill_idle_lanes(args: argparse.Namespace, threads: int) -> int:
    """Idle lanes per prefill worker: by default the machine's cores outside the prefill pool,
    in lanes of the prefill workers' thread count, shared among them (1P1D on 2 cores: 1)."""
    if args.prefill_idle_lanes is not None:
        return args.prefill_idle_lanes
    per_lane = args.prefill_threads or threads
    spare = max(0, (os.cpu_count() or 1) - args.prefill_workers * per_lane)
    return spare // per_lane // args.prefill_workers


PACING_SHARE_OF_TPOT = 0.6  # of the TPOT target: 36 ms of 60, the rest is headroom for jitter


def decode_step_interval_ms(args: argparse.Namespace, threads: int, idle_lanes: int) -> float:
    """Decode step pacing (decode_node/step_pacing.py): the most time between decode steps
    while prompts queue for prefill. By default 0.6 x --tpot-slo-ms (36 ms of 60) when prefill
    can run on the decode workers' cores (idle lanes, or more prefill and decode threads than
    cores, as in 2P1D on 2 cores): the gaps between paced steps go to prefill. Else 0 (nobody
    to yield to). Pacing only spaces step starts: a step that itself takes the interval or
    longer is not delayed."""
    if args.decode_step_interval_ms is not None:
        return args.decode_step_interval_ms
    want = (args.prefill_workers * (args.prefill_threads or threads)
            + args.decode_workers * (args.decode_threads or threads))
    shared = idle_lanes > 0 or want > (os.cpu_count() or 1)
    return round(PACING_SHARE_OF_TPOT * args.tpot_slo_ms, 1) if shared else 0.0


def plan_children(args: argparse.Namespace, run_dir: str) -> list[Child]:
    py = [sys.executable, "-m", "pdserve.cli"]
    gw_inbox = f"ipc://{run_dir}/gateway.sock"
    n_workers = 1 if args.colocated else args.prefill_workers + args.decode_workers
    threads = args.threads or max(1, (os.cpu_count() or 1) // n_workers)  # each worker's share
    engine_argv = engine_args_to_argv(args)

    def role_threads(role_value: int | None) -> list[str]:
        return ["--threads", str(role_value or threads)]
    gw_transport = {"auto": "auto", "shm": "shm", "zmq-ipc": "zmq", "zmq-tcp": "zmq"}[args.kv_transport]
    gateway = py + ["gateway", "--model", args.model, "--host", args.host, "--port", str(args.port),
                    "--worker-bind", gw_inbox, "--kv-transport", gw_transport,
                    "--on-decode-failure", args.on_decode_failure,
                    "--max-queued-requests", str(args.max_queued_requests),
                    "--max-queued-tokens", str(args.max_queued_tokens),
                    "--max-queue-wait", str(args.max_queue_wait),
                    "--stream-write-timeout", str(args.stream_write_timeout),
                    *(["--chat-template", args.chat_template] if args.chat_template else []),
                    "--stuck-after", str(args.stuck_after)]
    if args.request_timeout:
        gateway += ["--request-timeout", str(args.request_timeout)]
    if args.served_model_name:
        gateway += ["--served-model-name", args.served_model_name]
    if args.max_model_len:
        gateway += ["--max-model-len", str(args.max_model_len)]
    children = [Child("gateway", gateway)]
    common = ["--gateway", gw_inbox] + engine_argv
    kv_mac = ["--kv-payload-mac", getattr(args, "kv_payload_mac", "auto")]
    if args.colocated:
        budget = ["--max-num-batched-tokens", str(prefill_budget(args))]  # later flags win
        children.append(Child("colocated-0", py + ["colocated", "--bind", f"ipc://{run_dir}/colocated-0.sock"]
                              + common + budget + role_threads(None)))
        return children
    idle_lanes = prefill_idle_lanes(args, threads)
    lanes = ["--idle-lanes", str(idle_lanes)]
    pacing = ["--step-interval-ms", str(decode_step_interval_ms(args, threads, idle_lanes))]
    for i in range(args.prefill_workers):
        budget = ["--max-num-batched-tokens", str(prefill_budget(args))]  # later flags win
        children.append(Child(f"prefill-{i}", py + ["prefill", "--bind", f"ipc://{run_dir}/prefill-{i}.sock"]
                              + common + kv_mac + budget + role_threads(args.prefill_threads) + lanes,
                              nice=args.prefill_nice))
    # a decode worker with no prefill in flight borrows the prefill pool's cores
    idle_threads = args.decode_idle_threads or max(args.decode_threads or threads,
                                                   (os.cpu_count() or 1) // args.decode_workers)
    for i in range(args.decode_workers):
        kv_bind = "tcp://127.0.0.1:0" if args.kv_transport == "zmq-tcp" else f"ipc://{run_dir}/decode-{i}-kv.sock"
        extra = ["--no-shm"] if args.kv_transport in ("zmq-ipc", "zmq-tcp") else []
        children.append(Child(f"decode-{i}", py + ["decode", "--bind", f"ipc://{run_dir}/decode-{i}.sock",
                                                  "--kv-bind", kv_bind, "--lease-ttl", str(args.lease_ttl)]
                              + extra + common + kv_mac
                              + role_threads(args.decode_threads) + ["--idle-threads", str(idle_threads)]
                              + pacing))
    return children


def wait_healthy(url: str, children: list[Child], timeout_s: float,
                 stopping: Callable[[], bool] = lambda: False) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopping():
        if any(c.proc is not None and c.proc.poll() is not None for c in children):
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve %(levelname)s: %(message)s")
    args.model = resolve_model(args.model)  # make the default model once, before the children
    run_dir = tempfile.mkdtemp(prefix="pdserve-")
    os.chmod(run_dir, 0o700)
    env = dict(os.environ, PDSERVE_CLUSTER_SECRET=secrets.token_hex(32))
    if args.api_key:
        env["PDSERVE_API_KEY"] = args.api_key
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
        url = f"http://{args.host}:{args.port}"
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
            print(f"pdserve: stopped on {stopped_by[0]}; all {len(children)} processes exited", file=sys.stderr,
                  flush=True)


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
