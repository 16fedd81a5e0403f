"""Keep large allocations in the heap (glibc), so KV-sized buffers are reused, not re-faulted.

ZMQ allocates a fresh buffer for every multi-MB KV frame it receives; by default glibc serves
those with mmap and returns them with munmap, so every frame pays first-touch page faults
that cost more than the copy itself (bench-kv: ZMQ IPC 16% -> 25% of memcpy). Raising the
mmap/trim thresholds keeps such buffers in the heap for reuse. The engine's steps gain a little
too: a 512-token step's activations are multi-MB tensors ([T, 2 x intermediate] is 6 MB on a 135M
model), which glibc's defaults may mmap, or trim off the heap's top, and fault in again; kept in the
heap, a real-shape 512-token prefill step ran 1-2% faster on two threads (`pdserve bench-engine
--glibc-malloc-defaults` for the figure without). Every worker process calls this at start
(pdserve/worker_process.py), as do the benchmarks that time the engine as a worker runs it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_large_allocations_in_heap(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc: nothing to tune
    ok = (
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
        and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
        and mallopt(_M_TOP_PAD, 64 << 20) == 1
    )
    if not ok:
        log.debug("mallopt refused the KV allocation tuning")
    return ok
