"""The CPU decode-attention kernel in C (kernels/cpu_decode_attention.c): built with the
machine's C compiler at first use, cached, loaded with ctypes.

Why C: batched decode attention in torch must first gather each sequence's KV out of the
paged pool into a dense tensor (SDPA takes no block table), so every KV byte is read, written
and read again; the kernel reads each K/V row once, in place. At batch 32 x ~270 tokens of the
bench model the gather alone was 8.5 of the 19 ms of attention in a step (torch profiler, one
thread); the kernel does the whole attention in ~12 ms (docs/benchmarks/engine.md).

Built as `<cache>/pdserve/kernels/cpu_decode_attention-<hash>.so`, the hash covering the source,
the flags and this machine's CPU (the code is compiled for it: -march=native). With no compiler,
or a failed build, `available()` is False and attention stays on the pure-torch path.
`PDSERVE_ATTENTION=torch` also keeps it off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
# -ffast-math for the compile step only (vectorised expf and dot-product reductions); linking
# without it keeps crtfastmath.o (which would flush denormals process-wide) out of the library.
# gnu11, not c11: ISO C mode turns off FMA contraction.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=gnu11"]
LINK_FLAGS = ["-shared", "-lm"]
# OpenMP threads come from torch's own libgomp (same soname, already loaded); a compiler
# without OpenMP still builds the kernel, single-threaded.
OPENMP_FLAGS = ["-fopenmp"]


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pdserve" / "kernels"


def _build(cc: str, openmp: bool) -> Path:
    src = SOURCE.read_bytes()
    extra = OPENMP_FLAGS if openmp else []
    key = hashlib.sha256(src + " ".join([cc, *COMPILE_FLAGS, *LINK_FLAGS, *extra]).encode() + _cpu_id().encode())
    out = _cache_dir() / f"{SOURCE.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # workers may build at once: rename is atomic
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        subprocess.run([cc, *COMPILE_FLAGS, *extra, "-c", str(SOURCE), "-o", str(obj)], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([cc, str(obj), "-o", str(lib), *LINK_FLAGS, *extra], check=True, capture_output=True,
                       timeout=120)
        os.replace(lib, out)
    return out


def _build_any(cc: str) -> Path:
    try:
        return _build(cc, openmp=True)
    except subprocess.SubprocessError as e:
        log.warning("no OpenMP with %s (%s): the CPU decode-attention kernel runs on one thread", cc,
                    (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-300:])
        return _build(cc, openmp=False)


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: CPU decode attention stays on the torch path (gathers KV)")
        return None
    try:
        lib = ctypes.CDLL(str(_build_any(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("building the CPU decode-attention kernel failed (%s %s): using the torch path",
                    e, detail.decode(errors="replace")[-500:])
        return None
    fn = lib.paged_decode_attention_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (tried once per process)."""
    return _library() is not None


def can_run(query: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """fp32 CPU tensors, the pool contiguous (query rows may lie apart, as in the model's fused qkv; heads and head_dim must be dense, else they are copied)."""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and kv_layer.dtype == torch.float32
            and kv_layer.is_contiguous() and available())


def paged_decode_attention(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> bool:
    """query [n, Hq, D], kv_layer [2, N, bs, Hkv, D], block_tables [>=n, W] int32,
    context_lens [>=n] int32 -> out [n, Hq, D]. False when the kernel refuses the shapes
    (over its limits); the caller then takes the torch path. Runs without the GIL."""
    n, hq, d = query.shape
    if query.stride(2) != 1 or query.stride(1) != d:  # rows may be apart (the model's fused qkv view)
        query = query.contiguous()
    _, num_blocks, bs, hkv, _ = kv_layer.shape
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    assert block_tables.is_contiguous() and context_lens.is_contiguous() and out.is_contiguous()
    rc = _library().paged_decode_attention_f32(
        query.data_ptr(), query.stride(0), kv_layer.data_ptr(), num_blocks * bs, block_tables.data_ptr(),
        block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), n, hq, hkv, d, bs, scale,
        torch.get_num_threads())
    return rc == 0
