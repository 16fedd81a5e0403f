"""A decode worker's KV pool on a GPU, mapped by prefill workers on the same GPU (CUDA IPC): the
GPU counterpart of kvtransfer/shm.py.

- `CudaIpcTensor.create(shape, dtype, device)`: the owner (decode worker). The pool is one
  cudaMalloc of its own (not a slice of torch's caching allocator), so its IPC handle maps the
  pool at offset 0. Its `name` is "cudaipc-" + the GPU's UUID + "-" + the handle's 64 bytes in
  hex: a string that travels in WorkerInfo and KvDestination like a shared-memory name.
- `CudaIpcTensor.attach(name, shape, dtype)`: a writer (prefill worker) opens the handle on the
  GPU the name names (cudaIpcOpenMemHandle; a process cannot open its own handles). `close()`
  closes the mapping; the owner's `close()` frees nothing while a tensor view lives (the tensor
  holds the allocation), so close it last.
- The handle is a capability like a shm name: any process of the host's users that reads it can
  map the pool, so it travels only on the authenticated control plane.

Needs CuPy (the GPU extra) for the runtime's IPC calls; `available()` says whether it is there.
"""

from __future__ import annotations

import math

import torch

NAME_PREFIX = "cudaipc-"


def available() -> bool:
    """Whether pools can be shared over CUDA IPC here: a CUDA device and CuPy."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID (as nvidia-smi prints it, without "GPU-"): the same GPU in every process."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _device_of(uuid: str) -> torch.device:
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return torch.device("cuda", i)
    raise ValueError(f"no visible GPU has UUID {uuid} (a CUDA IPC pool is mapped on its own GPU)")


def parse_name(name: str) -> tuple[str, bytes]:
    """(GPU UUID, IPC handle) of a pool's name."""
    if not name.startswith(NAME_PREFIX):
        raise ValueError(f"not a CUDA IPC pool name: {name[:24]!r}")
    uuid, _, handle = name[len(NAME_PREFIX) :].rpartition("-")
    try:
        raw = bytes.fromhex(handle)
    except ValueError:
        raw = b""
    if not uuid or len(raw) != 64:
        raise ValueError("malformed CUDA IPC pool name")
    return uuid, raw


def is_cuda_ipc_name(name: str | None) -> bool:
    return bool(name) and str(name).startswith(NAME_PREFIX)


def _as_tensor(ptr: int, nbytes: int, owner, device: torch.device, shape, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor over `nbytes` of device memory at `ptr` (kept alive by `owner`)."""
    import cupy

    with cupy.cuda.Device(device.index):
        memptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, nbytes, owner), 0)
        raw = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=memptr)
        return torch.from_dlpack(raw).view(dtype).view(shape)


class CudaIpcTensor:
    def __init__(self, name: str, tensor: torch.Tensor, owner: bool, close_handle: int | None) -> None:
        self.name = name
        self.tensor: torch.Tensor | None = tensor
        self.device = tensor.device
        self.owner = owner
        self._opened = close_handle  # attach: the mapped pointer to close
        self._closed = False

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> "CudaIpcTensor":
        """A new zero-filled pool of `shape`/`dtype` on `device`, exported for CUDA IPC."""
        import cupy

        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with cupy.cuda.Device(device.index):
            mem = cupy.cuda.Memory(max(nbytes, 1))  # its own cudaMalloc: the handle maps it at offset 0
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(mem.ptr))
        tensor = _as_tensor(mem.ptr, nbytes, mem, device, shape, dtype)
        tensor.zero_()
        return cls(NAME_PREFIX + device_uuid(device) + "-" + handle.hex(), tensor, owner=True, close_handle=None)

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "CudaIpcTensor":
        """Map another process's pool (made by `create`) as a tensor on its GPU."""
        import cupy

        uuid, handle = parse_name(name)
        device = _device_of(uuid)
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with cupy.cuda.Device(device.index):
            lazy_peer_access = getattr(cupy.cuda.runtime, "cudaIpcMemLazyEnablePeerAccess", 1)
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, lazy_peer_access)
        try:
            tensor = _as_tensor(ptr, nbytes, None, device, shape, dtype)
        except BaseException:
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            raise
        return cls(name, tensor, owner=False, close_handle=ptr)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop this object's tensor; a writer also closes its mapping (after its GPU work is done:
        nothing may use a view of it afterwards)."""
        if self._closed:
            return
        self._closed = True
        tensor, self.tensor = self.tensor, None
        if self._opened is not None and tensor is not None:
            import cupy

            torch.cuda.synchronize(self.device)
            del tensor
            with cupy.cuda.Device(self.device.index):
                cupy.cuda.runtime.ipcCloseMemHandle(self._opened)
            self._opened = None

    def __enter__(self) -> "CudaIpcTensor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
