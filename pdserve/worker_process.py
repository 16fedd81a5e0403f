"""How a worker process is configured before it runs an engine or moves KV, in one place: the
worker roles (cli/roles.py) and every benchmark that times what a worker does (bench/) call
`configure_worker_process`, so a benchmark measures the process the workers are.

- glibc keeps large allocations in its heap (kvtransfer/malloc_tuning.py): KV frames and a
  step's multi-MB activations reuse warm pages instead of faulting fresh ones in.
- KV transfers' contiguous copies into another worker's pool use streaming stores
  (kernels/stream_copy.py, installed through kvtransfer/sender.py `use_contiguous_copy`:
  kvtransfer/ does not import kernels/): the blocks written are not read again soon.

It lives here, above both kvtransfer/ and kernels/, because neither may import the other.
"""

from __future__ import annotations

from typing import Literal

ContiguousCopy = Literal["streaming", "memmove"]


def configure_worker_process(contiguous_copy: ContiguousCopy = "streaming") -> None:
    """Configure this process as a worker's (idempotent). `contiguous_copy="memmove"` leaves
    KV copies on ctypes.memmove, the process default: only for a benchmark's comparison against
    the workers' copy, in a process of its own."""
    from pdserve.kernels import stream_copy
    from pdserve.kvtransfer.malloc_tuning import keep_large_allocations_in_heap
    from pdserve.kvtransfer.sender import use_contiguous_copy

    keep_large_allocations_in_heap()
    if contiguous_copy == "streaming":
        use_contiguous_copy(stream_copy.copy_addr)
