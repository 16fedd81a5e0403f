"""A kernel's C file built for one x86 instruction set instead of -march=native, so a test can run
every vector path the machine can (the AVX2 one on an AVX-512 machine too) and compare their bits."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

from pdserve.kernels.cpu_native import ISA_LEVELS, LINK_FLAGS, OPENMP_FLAGS, compile_flags, isa_unrunnable

ISAS = tuple(ISA_LEVELS)  # avx512 (x86-64-v4), avx2 (x86-64-v3), sse2 (the baseline)


def cannot_run(isa: str) -> str | None:
    """Why this machine cannot build and run the `isa` build (an ISA_LEVELS key), or None."""
    if shutil.which("cc") is None:
        return "needs a C compiler"
    return isa_unrunnable(isa)


def build(source: Path, isa: str, out_dir: Path) -> ctypes.CDLL:
    """`source` compiled as cpu_native builds it, but for `isa` (callers check `cannot_run` first)."""
    flags = compile_flags(isa)
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
