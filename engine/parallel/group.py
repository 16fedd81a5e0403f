"""One rank's handle on its tensor-parallel group: a gloo process group of its own (no global
default group), rendezvous on a loopback TCPStore that rank 0 hosts, every collective bounded by
`timeout_s` so a dead or stuck rank raises instead of hanging the others."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.parallel.shard import TensorParallelShard


class TensorParallelError(RuntimeError):
    """A collective failed: a rank died, stalled past the timeout, or refused to start."""


def host_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`.port`), created before the ranks start."""
    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_store(port: int, size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=timeout_s))


class TensorParallelGroup:
    def __init__(self, shard: TensorParallelShard, store: dist.TCPStore, timeout_s: float) -> None:
        self.shard = shard
        self.rank, self.size = shard.rank, shard.size
        self.timeout_s = timeout_s
        gloo: Any = dist.ProcessGroupGloo  # its collectives and options are not in torch's type stubs
        opts = gloo._Options()
        opts._timeout = timedelta(seconds=timeout_s)
        opts._devices = [gloo.create_device(hostname="127.0.0.1")]
        self.store = store  # kept alive: rank 0's is the rendezvous server
        self.pg = gloo(store, shard.rank, shard.size, opts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        self._wait(self.pg.allreduce([x]))
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype), in place; returns it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.pg.broadcast([x], opts))
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [S, C] side by side on rank 0: [S, N*C] there, None elsewhere."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self._wait(self.pg.gather([parts] if self.rank == 0 else [], [x], opts))
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise TensorParallelError(f"tensor-parallel rank {self.rank}: collective failed: {e}") from e
