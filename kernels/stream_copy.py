"""Copies that bypass the caches (kernels/cpu_stream_copy.c): a KV transfer's writes into a
decode worker's pool, which the writer does not read soon (a prefill worker writing over shared
memory never; a decode worker landing ZeroMQ frames only when it decodes the request). In `pdserve bench-kv` shared-memory
transfers went 1.09-1.37x faster than with torch's `copy_`, on an AVX-512 EPYC
(docs/benchmarks/kv_transfer.md)."""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path

from pdserve.kernels.cpu_native import load_kernel

SOURCE = Path(__file__).with_name("cpu_stream_copy.c")
STREAM_MIN_BYTES = 256 << 10  # below this the copy's lines may as well stay cached


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None  # SSE2 streaming stores: x86 only (elsewhere torch's copy runs)
    built = load_kernel(SOURCE)
    if built is None:
        return None
    # PyDLL: the call keeps the GIL. A piece (hundreds of KB, tens of microseconds) is shorter than
    # the wait to take the GIL back from a prefill worker's other lane when it is running Python.
    lib = ctypes.PyDLL(built._name, handle=built._handle)
    if lib is not None:
        lib.stream_copy.restype = None
        lib.stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


def copy_addr(dst: int, src: int, nbytes: int) -> None:
    """`nbytes` from address `src` to `dst` (contiguous CPU memory, not overlapping): streaming
    stores from STREAM_MIN_BYTES up when the kernel built, else ctypes.memmove. What workers install
    for KV transfers (kvtransfer/sender.py `use_contiguous_copy`)."""
    lib = _library() if nbytes >= STREAM_MIN_BYTES else None
    if lib is not None:
        lib.stream_copy(dst, src, nbytes)
    else:
        ctypes.memmove(dst, src, nbytes)
