"""A kernel's C file built for one x86 instruction set instead of -march=native, so a test can run
every vector path the machine can (the AVX2 one on an AVX-512 machine too) and compare their bits."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

from pdserve.kernels.cpu_native import COMPILE_FLAGS, LINK_FLAGS, OPENMP_FLAGS

# compiler flags, and the /proc/cpuinfo flags a CPU needs to run the build
ISAS = {
    "sse2": ([], set()),  # x86-64's baseline: 4-float vectors, no FMA
    "avx2": (["-mavx2", "-mfma"], {"avx2", "fma"}),
    "avx512": (["-mavx512f", "-mavx2", "-mfma"], {"avx512f", "avx2", "fma"}),
}


def _cpu_flags() -> set[str]:
    try:
        return {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()}
    except OSError:
        return set()


def cannot_run(isa: str) -> str | None:
    """Why this machine cannot build and run the `isa` build, or None."""
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None:
        return "needs x86-64 and a C compiler"
    missing = ISAS[isa][1] - _cpu_flags()
    return f"this CPU lacks {' '.join(sorted(missing))}" if missing else None


def build(source: Path, isa: str, out_dir: Path) -> ctypes.CDLL:
    """`source` compiled as cpu_native builds it, but for `isa` (callers check `cannot_run` first)."""
    flags = [f for f in COMPILE_FLAGS if not f.startswith("-march=")] + ISAS[isa][0]
    lib = out_dir / f"{source.stem}-{isa}.so"
    try:
        subprocess.run(["cc", *flags, *OPENMP_FLAGS, str(source), "-o", str(lib), *LINK_FLAGS], check=True)
    except subprocess.CalledProcessError:  # no OpenMP: one thread, as cpu_native falls back
        subprocess.run(["cc", *flags, str(source), "-o", str(lib), *LINK_FLAGS], check=True)
    return ctypes.CDLL(str(lib))


def isa_variant(isa: str, source: Path, out_dir: Path, like: ctypes.CDLL, *functions: str) -> ctypes.CDLL:
    """`source` built for `isa` (skipping the test where this CPU cannot run it), its `functions`
    typed as in `like`, the machine's own build of the same file."""
    import pytest

    if why := cannot_run(isa):
        pytest.skip(f"{isa} build: {why}")
    lib = build(source, isa, out_dir)
    for name in functions:
        mine, theirs = getattr(lib, name), getattr(like, name)
        mine.argtypes, mine.restype = theirs.argtypes, theirs.restype
    return lib
