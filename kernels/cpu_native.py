"""The CPU kernels in C, built with the machine's C compiler at first use, cached, loaded with
ctypes:
- kernels/cpu_decode_attention.c, decode attention. Batched decode attention in torch must first
  gather each sequence's KV out of the paged pool into a dense tensor (SDPA takes no block
  table), so every KV byte is read, written and read again; the kernel reads each K/V row once,
  in place. At batch 32 x ~270 tokens of the bench model the gather alone was 8.5 of the 19 ms
  of attention in a step (torch profiler, one thread); the kernel does the whole attention in
  ~12 ms (docs/benchmarks/engine.md).
- kernels/cpu_prefill_flash.c, prefill attention (prompt chunks, causal, any earlier context)
  read in place from the pool, FlashAttention-style at the machine's full vector width (AVX-512
  where the compiler targets it): ~1.9x kernels/cpu_prefill_attention.c, its predecessor, which
  stays for head sizes the flash kernel's vectors do not divide, and faster than torch's CPU
  flash SDPA on contiguous tensors in every case measured (docs/benchmarks/prefill_attention.md).
- kernels/cpu_gemv.c, the one-row linear on an `[in, out]` weight (TransposedLinear: torch
  without oneDNN, or the panel copy switched off): MKL's GEMV does not go faster with a second
  thread on this machine; this one splits the output columns between threads
  (docs/benchmarks/engine.md). With oneDNN, 1-16 rows go to kernels/panel_gemm.py instead.

`load_kernel` builds and loads any of them, and the C files of kernels/layer_ops.py,
kernels/panel_gemm.py and kernels/decode_layers.py. Each is built as `<cache>/pdserve/kernels/<name>-<hash>.so`, the hash covering the source, the
flags and this machine's CPU (the code is compiled for it: -march=native, or the older instruction
set PDSERVE_KERNEL_ISA names). With no compiler, or a failed build, its `available()` is False and
the torch path runs instead.
`PDSERVE_ATTENTION=torch` keeps the attention kernel off.
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
from typing import TypeVar

import torch

from pdserve.env import EnvError, settings

log = logging.getLogger(__name__)
_Lib = TypeVar("_Lib")

ATTENTION_SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
PREFILL_SOURCE = Path(__file__).with_name("cpu_prefill_attention.c")
FLASH_SOURCE = Path(__file__).with_name("cpu_prefill_flash.c")
GEMV_SOURCE = Path(__file__).with_name("cpu_gemv.c")
# -ffast-math for the compile step only (vectorised expf and dot-product reductions); linking
# without it keeps crtfastmath.o (which would flush denormals process-wide) out of the library.
# gnu11, not c11: ISO C mode turns off FMA contraction.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=gnu11"]
# PDSERVE_KERNEL_ISA: the -march each build takes, and the /proc/cpuinfo flags a CPU needs to run
# it. The x86-64 levels are what other machines have: v4 AVX-512 without VNNI (Skylake-SP), v3 AVX2
# + FMA + F16C (Haswell on, Zen 1-3, most laptops), the baseline SSE2. An AVX-512 machine builds
# and runs all of them, so its tests and benchmarks cover the paths an AVX2 one takes.
ISA_LEVELS = {
    "avx512": ("-march=x86-64-v4", {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"}),
    "avx2": ("-march=x86-64-v3", {"avx2", "fma", "f16c", "bmi2", "movbe"}),
    "sse2": ("-march=x86-64", set()),
}
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


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        return set()


def isa_unrunnable(isa: str) -> str | None:
    """Why this machine cannot build and run kernels for `isa` (an ISA_LEVELS key), or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"{isa} is an x86-64 level and this is {platform.machine()}"
    missing = ISA_LEVELS[isa][1] - cpu_flags()
    return f"this CPU lacks {' '.join(sorted(missing))}" if missing else None


def compile_flags(isa: str = "native") -> list[str]:
    """COMPILE_FLAGS with -march for `isa` (native: this CPU's own; else an ISA_LEVELS key)."""
    if isa == "native":
        return list(COMPILE_FLAGS)
    if why := isa_unrunnable(isa):
        raise EnvError(f"PDSERVE_KERNEL_ISA={isa}: {why}")
    return [f for f in COMPILE_FLAGS if not f.startswith("-march=")] + [ISA_LEVELS[isa][0]]


def _cache_dir() -> Path:
    return settings().kernel_cache_dir


def _build(source: Path, cc: str, openmp: bool) -> Path:
    src = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # + headers
    extra = OPENMP_FLAGS if openmp else []
    flags = compile_flags(settings().kernel_isa)
    key = hashlib.sha256(src + " ".join([cc, *flags, *LINK_FLAGS, *extra]).encode() + _cpu_id().encode())
    out = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # workers may build at once: rename is atomic
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        subprocess.run(
            [cc, *flags, *extra, "-c", str(source), "-o", str(obj)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [cc, str(obj), "-o", str(lib), *LINK_FLAGS, *extra], check=True, capture_output=True, timeout=120
        )
        os.replace(lib, out)
    return out


def _build_any(source: Path, cc: str) -> Path:
    try:
        return _build(source, cc, openmp=True)
    except subprocess.SubprocessError as e:
        log.warning(
            "no OpenMP with %s (%s): %s runs on one thread",
            cc,
            (getattr(e, "stderr", b"") or b"").decode(errors="replace")[-300:],
            source.name,
        )
        return _build(source, cc, openmp=False)


@functools.lru_cache(maxsize=None)
def load_kernel(source: Path) -> ctypes.CDLL | None:
    """The C file `source` built for this machine (cached) and loaded; None, with a warning, when
    there is no compiler or the build fails (the caller's torch twin runs). Once per process."""
    cc = settings().cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: %s is not built, its torch twin runs instead", source.name)
        return None
    try:
        return ctypes.CDLL(str(_build_any(source, cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning(
            "building %s failed (%s %s): its torch twin runs instead",
            source.name,
            e,
            detail.decode(errors="replace")[-500:],
        )
        return None


def built(lib: _Lib | None) -> _Lib:
    """A kernel library (`_library()` and the like) its caller has checked was built (`available()`)."""
    if lib is None:
        raise RuntimeError("kernel library not built: check available() before calling it")
    return lib


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_kernel(ATTENTION_SOURCE)
    names = (
        "paged_decode_attention_f32",
        "paged_decode_attention_bf16",
        "paged_decode_attention_q8",
        "paged_decode_attention_f8",
    )
    for fn in (getattr(lib, name) for name in names) if lib is not None else ():
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_int,  # window (0: none)
            ctypes.c_float,  # softcap (0: none)
            ctypes.c_int,
        ]
    return lib


# (prefill kernel, dtype of queries and output, dtype of the pool) -> its C entry point; others are refused
_PREFILL_ENTRIES = {
    (PREFILL_SOURCE, torch.float32, torch.float32): "paged_prefill_attention_f32",
    (FLASH_SOURCE, torch.float32, torch.float32): "prefill_flash_f32",
    (FLASH_SOURCE, torch.bfloat16, torch.bfloat16): "prefill_flash_bf16",
    (FLASH_SOURCE, torch.float32, torch.int8): "prefill_flash_q8",  # --kv-cache-dtype int8
    (FLASH_SOURCE, torch.float32, torch.uint8): "prefill_flash_f8",  # --kv-cache-dtype fp8 (e4m3 rows)
}
# the decode kernel's entry point for fp32 queries over a quantized pool, by the pool's dtype
_DECODE_QUANTIZED = {torch.int8: "paged_decode_attention_q8", torch.uint8: "paged_decode_attention_f8"}


@functools.lru_cache(maxsize=None)
def _prefill_library(source: Path = PREFILL_SOURCE) -> ctypes.CDLL | None:
    lib = load_kernel(source)
    for (src, _, _), name in _PREFILL_ENTRIES.items():
        if lib is None or src != source:
            continue
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            *[ctypes.c_int] * 6,
            ctypes.c_float,
            ctypes.c_int,  # window (0: none)
            ctypes.c_float,  # softcap (0: none)
            ctypes.c_int,
        ]
    return lib


@functools.lru_cache(maxsize=None)
def _gemv_library() -> ctypes.CDLL | None:
    lib = load_kernel(GEMV_SOURCE)
    for fn in (lib.gemv_f32, lib.gemv_bf16) if lib is not None else ():
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return lib


def gemv_available() -> bool:
    """Whether the one-row linear is built and loaded (tried once per process)."""
    return _gemv_library() is not None


def gemv(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, in] . weight_t [in, out] (+ bias [out]) -> [1, out]; fp32 or bf16 (all one dtype; bf16
    summed in fp32, rounded once), contiguous, CPU (callers check `gemv_available()` first). Runs
    without the GIL."""
    n_in, n_out = weight_t.shape
    assert x.shape == (1, n_in) and x.is_contiguous() and weight_t.is_contiguous()
    assert x.dtype == weight_t.dtype in (torch.float32, torch.bfloat16)
    assert bias is None or (bias.dtype == x.dtype and bias.is_contiguous())
    y = torch.empty(1, n_out, dtype=x.dtype)
    lib = built(_gemv_library())
    rc = (lib.gemv_bf16 if x.dtype == torch.bfloat16 else lib.gemv_f32)(
        x.data_ptr(),
        weight_t.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n_in,
        n_out,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("gemv: no memory for the bf16 sums")
    return y


def available() -> bool:
    """Whether the kernel is built and loaded (tried once per process)."""
    return _library() is not None


def _pool_matches(query: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """The pool's dtype is the queries', or quantized rows (--kv-cache-dtype int8|fp8) under fp32 queries."""
    return kv_layer.dtype == query.dtype or (kv_layer.dtype in _DECODE_QUANTIZED and query.dtype == torch.float32)


def _takes(query: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """What the decode kernel takes: fp32 or bf16 CPU tensors (query and pool of one dtype, or fp32
    queries over an int8 or fp8 pool), the pool contiguous (query rows may lie apart, as in the model's
    fused qkv; heads and head_dim must be dense, else they are copied)."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and _pool_matches(query, kv_layer)
        and kv_layer.is_contiguous()
    )


def can_run(query: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether the decode kernel is built and takes these tensors."""
    return _takes(query, kv_layer) and available()


def can_run_prefill(query: torch.Tensor, kv_layer: torch.Tensor, source: Path = PREFILL_SOURCE) -> bool:
    """Whether the prefill kernel `source` is built and takes these tensors: CPU, the pool
    contiguous, queries and pool of dtypes it has an entry point for (fp32; bf16 and fp32 over
    int8 or fp8 rows for flash)."""
    return (
        query.device.type == "cpu"
        and (source, query.dtype, kv_layer.dtype) in _PREFILL_ENTRIES
        and kv_layer.is_contiguous()
        and prefill_available(source)
    )


def paged_decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> bool:
    """query [n, Hq, D], kv_layer [2, N, bs, Hkv, D] (int8, fp8: D + 4), block_tables [>=n, W] int32,
    context_lens [>=n] int32 -> out [n, Hq, D]; `window`: each query sees its last `window` keys
    only (the blocks before them are not read), `softcap`: tanh soft-capping of the scores.
    False when the kernel refuses the shapes (over its limits); the caller then takes the torch
    path. Runs without the GIL."""
    n, hq, d = query.shape
    if query.stride(2) != 1 or query.stride(1) != d:  # rows may be apart (the model's fused qkv view)
        query = query.contiguous()
    _, num_blocks, bs, hkv, _ = kv_layer.shape
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    assert block_tables.is_contiguous() and context_lens.is_contiguous() and out.is_contiguous()
    assert out.dtype == query.dtype and _pool_matches(query, kv_layer)
    lib = built(_library())
    entry = (
        getattr(lib, _DECODE_QUANTIZED[kv_layer.dtype])
        if kv_layer.dtype in _DECODE_QUANTIZED
        else lib.paged_decode_attention_bf16
        if query.dtype == torch.bfloat16
        else lib.paged_decode_attention_f32
    )
    rc = entry(
        query.data_ptr(),
        query.stride(0),
        kv_layer.data_ptr(),
        num_blocks * bs,
        block_tables.data_ptr(),
        block_tables.stride(0),
        context_lens.data_ptr(),
        out.data_ptr(),
        n,
        hq,
        hkv,
        d,
        bs,
        scale,
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    return rc == 0


def prefill_available(source: Path = PREFILL_SOURCE) -> bool:
    """Whether the prefill attention kernel is built and loaded (tried once per process)."""
    return _prefill_library(source) is not None


def paged_prefill_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    first: int,
    scale: float,
    out: torch.Tensor,
    source: Path = PREFILL_SOURCE,
    window: int | None = None,
    softcap: float | None = None,
) -> bool:
    """The chunks of sequences `first..` of a ragged batch: query [T, Hq, D] (all the batch's
    rows), their K/V already stored in kv_layer [2, N, bs, Hkv, D]; block_tables [B, W],
    cu_seqlens_q [B+1], context_lens [B] int32 -> out [T, Hq, D] at those sequences' rows, by
    the kernel in `source` (PREFILL_SOURCE, the tiled one, or FLASH_SOURCE); `window` and `softcap`
    as for paged_decode_attention (keys before a tile's window are not read). False when the kernel
    refuses the shapes; the caller then takes another kernel or the torch path."""
    _, hq, d = query.shape
    if query.stride(2) != 1 or query.stride(1) != d:  # rows may be apart (the model's fused qkv view)
        query = query.contiguous()
    _, num_blocks, bs, hkv, _ = kv_layer.shape
    n = context_lens.shape[0] - first
    for x in (block_tables, cu_seqlens_q, context_lens):
        assert x.dtype == torch.int32 and x.is_contiguous()
    assert out.is_contiguous() and out.shape == query.shape and out.dtype == query.dtype
    if n <= 0:
        return True
    rc = getattr(built(_prefill_library(source)), _PREFILL_ENTRIES[(source, query.dtype, kv_layer.dtype)])(
        query.data_ptr(),
        query.stride(0),
        kv_layer.data_ptr(),
        num_blocks * bs,
        block_tables.data_ptr(),
        block_tables.stride(0),
        cu_seqlens_q.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        first,
        n,
        hq,
        hkv,
        d,
        bs,
        scale,
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    return rc == 0
