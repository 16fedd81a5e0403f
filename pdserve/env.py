"""Every environment variable pdserve reads, in one place, read once into a frozen struct.

    PDSERVE_ATTENTION          auto | torch | triton   attention backend (torch: the pure-torch reference)
    PDSERVE_LAYER_OPS          auto | torch            a layer's elementwise ops in C, or torch
    PDSERVE_FUSED_DECODE       on | off                small decode steps through every layer in one C call
    PDSERVE_CPU_GEMV           auto | torch            the C few-row linears, or torch/oneDNN
    PDSERVE_KERNEL_ISA         native | avx512 | avx2 | sse2
                                                       the instruction set the C kernels are built for:
                                                       this CPU's own (default), or an older one it can
                                                       run (x86-64-v4 / -v3 / baseline), to test and
                                                       time the paths other machines take
    PDSERVE_TP_CORES           auto | off              tensor-parallel ranks pinned to their own cores / NUMA node
    PDSERVE_CLUSTER_SECRET     hex                     the cluster's HMAC secret ...
    PDSERVE_CLUSTER_SECRET_FILE path                   ... or a file holding it
    PDSERVE_PLANE_ENCRYPTION   auto | on | off         CURVE on the worker/KV planes: auto = tcp:// only
    PDSERVE_API_KEY            text                    the gateway's bearer key (or --api-key)
    PDSERVE_LOG_LEVEL          INFO, DEBUG, ...
    PDSERVE_CACHE_DIR          path                    the default model's cache, GGUF files' converted
                                                       tokenizers (~/.cache/pdserve)
    XDG_CACHE_HOME, CC                                 where C kernels are cached; the C compiler
    TRITON_INTERPRET           0 | 1                   Triton's interpreter (its kernels on CPU tensors)

`settings()` reads them at first use and keeps the result; the kernels' switches are then
attribute reads on the hot path. Tests that change the environment call `reload()`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


class EnvError(ValueError):
    """An environment variable holds a value pdserve does not take."""


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, "").strip().lower() or default
    if value not in allowed:
        raise EnvError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class Settings:
    attention: str  # auto | torch | triton
    layer_ops: str  # auto | torch
    fused_decode: bool
    cpu_gemv: str  # auto | torch
    kernel_isa: str  # native | avx512 | avx2 | sse2 (kernels/cpu_native.py)
    tp_cores: str  # auto | off (engine/parallel/core_sets.py)
    cluster_secret: str
    cluster_secret_file: str
    plane_encryption: str  # auto | on | off (protocol/plane_encryption.py)
    api_key: str | None
    log_level: str
    model_cache_dir: Path
    kernel_cache_dir: Path
    cc: str | None
    triton_interpret: bool

    @classmethod
    def from_environ(cls) -> Settings:
        env = os.environ
        cache_root = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(
            attention=_choice("PDSERVE_ATTENTION", "auto", ("auto", "torch", "triton")),
            layer_ops=_choice("PDSERVE_LAYER_OPS", "auto", ("auto", "torch")),
            fused_decode=_choice("PDSERVE_FUSED_DECODE", "on", ("on", "off")) == "on",
            cpu_gemv=_choice("PDSERVE_CPU_GEMV", "auto", ("auto", "torch")),
            kernel_isa=_choice("PDSERVE_KERNEL_ISA", "native", ("native", "avx512", "avx2", "sse2")),
            tp_cores=_choice("PDSERVE_TP_CORES", "auto", ("auto", "off")),
            cluster_secret=env.get("PDSERVE_CLUSTER_SECRET", "").strip(),
            cluster_secret_file=env.get("PDSERVE_CLUSTER_SECRET_FILE", "").strip(),
            plane_encryption=_choice("PDSERVE_PLANE_ENCRYPTION", "auto", ("auto", "on", "off")),
            api_key=env.get("PDSERVE_API_KEY") or None,
            log_level=env.get("PDSERVE_LOG_LEVEL", "INFO"),
            model_cache_dir=Path(env.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")),
            kernel_cache_dir=Path(cache_root) / "pdserve" / "kernels",
            cc=env.get("CC") or None,
            triton_interpret=env.get("TRITON_INTERPRET", "0") not in ("", "0"),
        )


@functools.cache
def settings() -> Settings:
    """The environment as it was at first use (raises EnvError on a value pdserve does not take)."""
    return Settings.from_environ()


def reload() -> Settings:
    """Read the environment again (tests that change it)."""
    settings.cache_clear()
    return settings()
