"""The memory a decode worker's KV pool lives in when prefill workers write it in place: POSIX
shared memory for a CPU pool (kvtransfer/shm.py), a CUDA IPC export for a GPU pool
(kvtransfer/cuda_ipc.py). Either has `.name` (what WorkerInfo advertises), `.tensor` and `close()`."""

from __future__ import annotations

import logging

import torch

from pdserve.kvtransfer import cuda_ipc
from pdserve.kvtransfer.cuda_ipc import CudaIpcTensor
from pdserve.kvtransfer.shm import SharedTensor

log = logging.getLogger(__name__)


def can_share_pool(device: str) -> bool:
    """Whether a pool on `device` can be shared: always on the CPU; on a GPU with CuPy's IPC calls
    (without them the pool stays private and prefill workers send KV over ZeroMQ)."""
    if torch.device(device).type == "cpu":
        return True
    if cuda_ipc.available():
        return True
    log.warning("KV pool on %s not shared: CUDA IPC needs CuPy (pip install cupy-cuda12x); KV goes over ZeroMQ", device)
    return False


def shared_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> SharedTensor | CudaIpcTensor:
    """A new zero-filled pool of `shape`/`dtype` on `device` that peers on this host can map."""
    if torch.device(device).type == "cpu":
        return SharedTensor.create(shape, dtype)
    return CudaIpcTensor.create(shape, dtype, torch.device(device))
