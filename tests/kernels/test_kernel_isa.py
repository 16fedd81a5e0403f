"""PDSERVE_KERNEL_ISA: the C kernels built for an older instruction set than the machine's, so an
AVX-512 machine runs (and CI checks) the paths an AVX2 machine takes."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import env
from pdserve.kernels import cpu_native, panel_gemm
from tests.kernels.isa_builds import cannot_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kernel_isa(monkeypatch, tmp_path):
    """Sets PDSERVE_KERNEL_ISA (and a kernel cache of the test's own) for the test's duration."""

    def use(isa: str) -> None:
        monkeypatch.setenv("PDSERVE_KERNEL_ISA", isa)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        env.reload()

    yield use
    monkeypatch.undo()
    env.reload()


@pytest.mark.parametrize("isa,tile_rows", [("avx2", 6), ("avx512", 16)])
def test_the_named_level_is_what_gets_built(kernel_isa, isa, tile_rows):
    """The panel GEMM's tile height shows which vector width the build took: 6 rows of ymm with
    AVX2, 16 of zmm with AVX-512, whatever the machine's own is."""
    if why := cannot_run(isa):
        pytest.skip(why)
    kernel_isa(isa)
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    lib = ctypes.CDLL(str(cpu_native._build(panel_gemm.SOURCE, cc, openmp=False)))
    assert lib.panel_tile_rows() == tile_rows
    flags = cpu_native.compile_flags(isa)
    assert cpu_native.ISA_LEVELS[isa][0] in flags and "-march=native" not in flags


def test_a_level_this_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: {"sse2", "avx2", "fma"})
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "x86_64")
    with pytest.raises(env.EnvError, match="lacks .*avx512f"):
        cpu_native.compile_flags("avx512")
    assert "-march=native" in cpu_native.compile_flags("native")


def test_an_unknown_level_is_refused(kernel_isa):
    with pytest.raises(env.EnvError, match="PDSERVE_KERNEL_ISA"):
        kernel_isa("avx10")


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(bool(os.environ.get("PDSERVE_KERNEL_ISA")), reason="already inside a forced-ISA run")
@pytest.mark.skipif(cannot_run("avx512") is not None, reason="the machine's own build is (at most) the AVX2 one")
def test_the_kernels_suite_passes_on_the_avx2_build():
    """On an AVX-512 machine the kernels suite again, every kernel built for x86-64-v3 (AVX2,
    FMA, F16C) as an AVX2-only CPU builds it: what such a machine would catch, this one does."""
    c_kernels_only = ["-k", "not triton and not torch_attention"]  # those tests run no C kernel
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *c_kernels_only, "tests/kernels"],
        cwd=ROOT,
        env={**os.environ, "PDSERVE_KERNEL_ISA": "avx2"},
        capture_output=True,
        text=True,
        timeout=1100,
    )
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
