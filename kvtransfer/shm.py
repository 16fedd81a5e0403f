"""Tensors in named POSIX shared memory: a decode worker's KV pool that a prefill worker on the
same host maps and writes in place (the CPU counterpart of CUDA IPC). Segments are created
0600 (same user only) under a random, unguessable name."""
from __future__ import annotations

import math
import secrets
from multiprocessing import resource_tracker, shared_memory

import torch


class SharedTensor:
    # Segments created by this process: attaching to one of them must not unregister it
    # from the resource tracker (the creator's own registration).
    _created_here: set[str] = set()

    def __init__(self, shm: shared_memory.SharedMemory, shape: tuple[int, ...], dtype: torch.dtype,
                 owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        numel = math.prod(shape)
        self.tensor = torch.frombuffer(shm.buf, dtype=dtype, count=numel).view(shape)

    @property
    def name(self) -> str:
        return self._shm.name

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype) -> "SharedTensor":
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        shm = shared_memory.SharedMemory(name=f"pdserve-{secrets.token_hex(12)}", create=True,
                                         size=max(nbytes, 1))
        cls._created_here.add(shm.name)
        return cls(shm, tuple(shape), dtype, owner=True)

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "SharedTensor":
        shm = shared_memory.SharedMemory(name=name)
        # Python < 3.13 registers attachers with the resource tracker, which would unlink the
        # owner's segment when this process exits. Only the creator unlinks.
        if name not in cls._created_here:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        if shm.size < nbytes:
            shm.close()
            raise ValueError(f"shared memory {name} holds {shm.size} bytes, expected {nbytes}")
        return cls(shm, tuple(shape), dtype, owner=False)

    def close(self) -> None:
        self.tensor = None  # drop our view before closing the mapping
        try:
            self._shm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the OS unmaps at exit
        if self.owner:
            self._created_here.discard(self._shm.name)
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
