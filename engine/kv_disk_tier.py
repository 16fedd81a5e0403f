"""A disk tier under the prefix cache (`--kv-offload-dir`, `--kv-offload-size`): full blocks' KV in
files named by their chained hash (protocol/block_hashes.py), so a prompt whose prefix left RAM
(evicted, or computed before this worker restarted) is read back instead of recomputed.

    write   a registered block's bytes (engine/kv_offload.py copies them out of the pool) go to a
            writer thread: a temporary file, then a rename, so no reader ever sees half a file;
            a block already on disk is not written again. Past `capacity_bytes` the least
            recently used files go.
    read    `prefetch` reads a waiting prompt's blocks in a thread as soon as it arrives; `take`
            hands them over when the engine loads them into the pool (reading now what the
            prefetch has not).
    check   a file is a header (magic, its block hash, the payload's size and blake2b digest) and
            the payload. A short, mismatched or unreadable file is a miss, deleted: wrong KV is
            never loaded, the prompt is computed instead.
    scope   files sit in a folder named by the engine's KV identity (model fingerprint, KV dtype,
            block size and layout), which a model or dtype change moves away from; the files
            outlive the process. Workers of one host may share the folder (a prefill worker's
            blocks serve its decode worker's reservations); each keeps what it indexed within its
            own size.

Files `<hash hex>.kvb`; the index (hash -> size, least recently used first) is rebuilt from the
folder at start, oldest modification first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"PDKVBLK1"
HEADER = struct.Struct("<8s16sQ16s")  # magic, block hash, payload bytes, blake2b-128 of the payload
SUFFIX = ".kvb"
MAX_PREFETCHED = 1024  # blocks read ahead and not yet taken (a prompt aborted while waiting leaves some)


def digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass
class TierCounters:
    """Totals since start (WorkerStats' kv_disk_* fields)."""

    writes: int = 0  # blocks written
    write_bytes: int = 0
    reads: int = 0  # blocks read back (prefetched or not)
    read_bytes: int = 0
    evictions: int = 0  # files removed to stay within the size
    corrupt: int = 0  # files found short, mismatched or unreadable (deleted; the block recomputed)
    dropped_writes: int = 0  # blocks not written: the writer was that far behind


class DiskKvTier:
    def __init__(self, root: str | Path, identity: str, capacity_bytes: int, queue_blocks: int = 256) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the disk tier's size must be > 0, got {capacity_bytes}")
        self.dir = Path(root) / hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "identity.txt").write_text(identity + "\n")  # (for people: whose blocks these are)
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._bytes = 0
        self._pending: set[bytes] = set()  # queued for the writer
        self._scan()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(maxsize=queue_blocks)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk-reader")
        self._prefetched: OrderedDict[bytes, Future[memoryview | None]] = OrderedDict()

    def _scan(self) -> None:
        found = []
        for p in self.dir.iterdir():
            if p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            if not p.name.endswith(SUFFIX):
                continue
            try:
                h, st = bytes.fromhex(p.name[: -len(SUFFIX)]), p.stat()
            except (ValueError, OSError):
                continue
            found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self._index[h] = size
            self._bytes += size
        self._evict_over_capacity()

    def path(self, block_hash: bytes) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    # --- what is here ---------------------------------------------------------------------------
    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def leading(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, are on disk (or on their way); a file another
        worker sharing the folder wrote is taken into the index when first asked for."""
        n = 0
        while n < len(hashes) and (hashes[n] in self or self._adopt(hashes[n])):
            n += 1
        return n

    def _adopt(self, block_hash: bytes) -> bool:
        try:
            size = self.path(block_hash).stat().st_size
        except OSError:
            return False
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = size
                self._bytes += size
                self._evict_over_capacity(keep=block_hash)
        return True

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    # --- writing ----------------------------------------------------------------------------
    def put(self, block_hash: bytes, payload: bytes) -> None:
        """Write `payload` as `block_hash`'s file, off the caller's thread (dropped, and counted,
        when the writer is `queue_blocks` behind: the block is only cached, never owed)."""
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return
            self._pending.add(block_hash)
        try:
            self._queue.put_nowait((block_hash, payload))
        except queue.Full:
            with self._lock:
                self._pending.discard(block_hash)
                self.counters.dropped_writes += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            h, payload = item
            try:
                self._write(h, payload)
            except OSError as e:  # (disk full, folder gone): the block stays computable
                log.warning("KV disk tier: writing block %s failed: %s", h.hex(), e)
            finally:
                with self._lock:
                    self._pending.discard(h)
                self._queue.task_done()

    def _write(self, h: bytes, payload: bytes) -> None:
        final = self.path(h)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, h, len(payload), digest(payload)))
            f.write(payload)
        os.replace(tmp, final)
        size = HEADER.size + len(payload)
        with self._lock:
            if h not in self._index:
                self._index[h] = size
                self._bytes += size
            self.counters.writes += 1
            self.counters.write_bytes += size
            self._evict_over_capacity(keep=h)

    def _evict_over_capacity(self, keep: bytes | None = None) -> None:
        """(Under the lock, or before the threads start.) Least recently used files out until the
        rest fits."""
        while self._bytes > self.capacity_bytes and self._index:
            h = next(iter(self._index))
            if h == keep:
                if len(self._index) == 1:
                    return
                self._index.move_to_end(h)
                continue
            self._bytes -= self._index.pop(h)
            self.counters.evictions += 1
            self.path(h).unlink(missing_ok=True)

    # --- reading ----------------------------------------------------------------------------
    def get(self, block_hash: bytes) -> memoryview | None:
        """The block's payload (a writable view of the file's one read, no copy), checked against
        its header; None when it is not here, or its file is short, mismatched or unreadable (then
        deleted and counted corrupt)."""
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        try:
            with open(self.path(block_hash), "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(data) != len(data):
                    data = bytearray()
        except FileNotFoundError:  # (removed by another worker sharing the folder): a plain miss
            with self._lock:
                if block_hash in self._index:
                    self._bytes -= self._index.pop(block_hash)
            return None
        except OSError:
            data = bytearray()
        payload = self._checked(block_hash, data)
        with self._lock:
            if payload is None:
                if block_hash in self._index:
                    self._bytes -= self._index.pop(block_hash)
                    self.counters.corrupt += 1
            else:
                self.counters.reads += 1
                self.counters.read_bytes += len(data)
        if payload is None:
            log.warning("KV disk tier: block %s failed its check; it will be computed", block_hash.hex())
            self.path(block_hash).unlink(missing_ok=True)
        return payload

    @staticmethod
    def _checked(block_hash: bytes, data: bytearray) -> memoryview | None:
        if len(data) < HEADER.size:
            return None
        magic, h, size, want = HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER.size :]
        if magic != MAGIC or h != block_hash or size != len(payload) or digest(payload) != want:
            return None
        return payload

    def prefetch(self, hashes: list[bytes]) -> None:
        """Start reading these blocks (those on disk and not already being read) in the reader
        thread, in order."""
        with self._lock:
            todo = [h for h in hashes if h in self._index and h not in self._prefetched]
        for h in todo:
            self._prefetched[h] = self._reader.submit(self.get, h)
        while len(self._prefetched) > MAX_PREFETCHED:
            self._prefetched.popitem(last=False)

    def take(self, block_hash: bytes) -> memoryview | None:
        """The block's payload: the prefetch's if one was started (waiting for it), else read now."""
        fut = self._prefetched.pop(block_hash, None)
        return fut.result() if fut is not None else self.get(block_hash)

    def flush(self) -> None:
        """Wait until every block queued so far is written."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, then stop the threads."""
        self._queue.put(None)
        self._writer.join()
        self._reader.shutdown(wait=True, cancel_futures=True)
