"""Tensors in named POSIX shared memory: a decode worker's KV pool that a prefill worker on the
same host maps and writes in place (the CPU counterpart of CUDA IPC).

- `SharedTensor.create(shape, dtype)`: the owner (decode worker). Segment name is
  "pdserve-" + 128 random bits, created 0600 (same user only); `close()` unlinks it, and the
  multiprocessing resource tracker unlinks it if the owner dies without closing.
- `SharedTensor.attach(name, shape, dtype)`: a writer (prefill worker). It maps the segment
  without registering it with the resource tracker: on Python < 3.13, `SharedMemory(name)`
  registers every attacher, and the tracker then unlinks the owner's segment when the attacher
  exits (and warns about a "leak"). Attachers never unlink.
- Lifetime: `close()` drops this object's mapping but never unmaps memory a tensor view may still
  use (torch.frombuffer keeps the buffer object alive, not a buffer export, so an explicit munmap
  would leave views dangling); the mapping goes when the last view is collected.
- Linux/macOS (POSIX shared memory); the segment lives in /dev/shm, which must be large enough
  for the pool (docker: --shm-size).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import secrets
from multiprocessing import resource_tracker

import torch

NAME_PREFIX = "pdserve-"

try:  # the primitive multiprocessing.shared_memory uses on POSIX
    import _posixshmem  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _reserve(fd: int, size: int, name: str) -> None:
    """Allocate the pages now, so a too-small /dev/shm fails here with a clear error instead of
    SIGBUS at the first write into the pool."""
    if not hasattr(os, "posix_fallocate"):  # pragma: no cover - macOS
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(
                e.errno,
                f"no room for a {size / 2**20:.0f} MiB shared-memory KV pool ({name}): "
                "enlarge /dev/shm (docker: --shm-size) or run without shared memory",
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


class _Segment:
    """One mapping of a POSIX shared-memory segment.

    The mapping is never closed explicitly: torch.frombuffer keeps a reference to the buffer
    object but not a buffer export, so an explicit munmap while a tensor view survives would
    leave that view dangling (segfault). Instead we drop our references and the kernel mapping
    goes away when the last tensor made from it is collected."""

    def __init__(self, name: str, create: bool, size: int = 0) -> None:
        if _posixshmem is None:  # pragma: no cover
            raise RuntimeError("shared-memory KV transport needs POSIX shared memory")
        self.name = name
        self.path = "/" + name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(self.path, flags, mode=0o600)
        try:
            if create:
                # the owner registers, so the tracker unlinks the name if the owner dies uncleanly
                resource_tracker.register(self.path, "shared_memory")
                os.ftruncate(fd, max(size, 1))
                _reserve(fd, max(size, 1), name)
            self.size = os.fstat(fd).st_size
            self.buf: memoryview | None = memoryview(mmap.mmap(fd, self.size))
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)

    def release(self) -> None:
        self.buf = None

    def unlink(self) -> None:
        try:
            _posixshmem.shm_unlink(self.path)
        except FileNotFoundError:
            pass
        resource_tracker.unregister(self.path, "shared_memory")


class SharedTensor:
    def __init__(self, segment: _Segment, shape: tuple[int, ...], dtype: torch.dtype, owner: bool) -> None:
        self._segment = segment
        self.owner = owner
        self.shape = tuple(shape)
        self.dtype = dtype
        self.nbytes = _nbytes(self.shape, dtype)
        self.tensor: torch.Tensor | None = (
            torch.frombuffer(segment.buf, dtype=torch.uint8, count=self.nbytes).view(dtype).view(self.shape)
        )
        self._closed = False

    @property
    def name(self) -> str:
        return self._segment.name

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype) -> "SharedTensor":
        """A new zero-filled segment holding a tensor of `shape`/`dtype`; this object owns it."""
        shape = tuple(int(s) for s in shape)
        nbytes = _nbytes(shape, dtype)
        segment = _Segment(NAME_PREFIX + secrets.token_hex(16), create=True, size=nbytes)
        try:
            return cls(segment, shape, dtype, owner=True)
        except BaseException:
            segment.unlink()
            raise

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "SharedTensor":
        """Map an existing segment (made by `create` elsewhere) as a tensor; never unlinks it."""
        if not name or "/" in name or "\x00" in name:
            raise ValueError(f"bad shared-memory name {name!r}")
        shape = tuple(int(s) for s in shape)
        segment = _Segment(name, create=False)
        nbytes = _nbytes(shape, dtype)
        if segment.size < nbytes:
            segment.release()
            raise ValueError(f"shared memory {name} holds {segment.size} bytes; {list(shape)} {dtype} needs {nbytes}")
        return cls(segment, shape, dtype, owner=False)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop this object's mapping; the owner also unlinks the name (no new process can
        attach). Views of `.tensor` taken elsewhere stay valid until they are collected."""
        if self._closed:
            return
        self._closed = True
        self.tensor = None
        self._segment.release()
        if self.owner:
            self._segment.unlink()

    def __enter__(self) -> "SharedTensor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
