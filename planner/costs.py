"""Cost models of one worker's engine steps, fitted by least squares to steps timed on the
target machine (planner/profile.py), one set per thread count:

    prefill step   t = a + b * tokens + c * attention pairs     (pairs: sum over its chunks of
                                                                chunk tokens x context attended)
    decode step    t = a + b * sequences + c * context tokens    (context: sum over the batch)
    mixed step     the prefill part plus the decode part, one intercept (colocated workers)
    KV transfer    t = bytes / bandwidth                         (the tail after the last layer)

A worker given more threads than it was profiled with uses the largest profiled; a worker
sharing the machine's cores with busier neighbours is slowed by the share it gets (simulate.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np


class Linear(msgspec.Struct, frozen=True):
    """t = intercept + sum(coef_i * x_i), seconds."""

    intercept: float
    coefs: list[float]
    rms_error_s: float = 0.0  # of the fit, on the points it was fitted to

    def __call__(self, *x: float) -> float:
        return self.intercept + sum(c * v for c, v in zip(self.coefs, x))


def fit(rows: Sequence[Sequence[float]], times: Sequence[float]) -> Linear:
    """Least squares of times on rows (no negative coefficients: costs do not fall with work)."""
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    design = np.hstack([np.ones((len(x), 1)), x])
    sol, *_ = np.linalg.lstsq(design, y, rcond=None)
    sol = np.maximum(sol, 0.0)
    for _ in range(3):  # refit the rest with a clipped coefficient held at 0
        keep = sol > 0
        if keep.all():
            break
        sub, *_ = np.linalg.lstsq(design[:, keep], y, rcond=None)
        sol = np.zeros_like(sol)
        sol[keep] = np.maximum(sub, 0.0)
    err = float(np.sqrt(np.mean((design @ sol - y) ** 2)))
    return Linear(float(sol[0]), [float(v) for v in sol[1:]], err)


class ThreadCosts(msgspec.Struct, frozen=True):
    prefill: Linear  # (tokens, attention pairs)
    decode: Linear  # (sequences, context tokens)

    def prefill_s(self, tokens: int, pairs: float) -> float:
        return self.prefill(tokens, pairs)

    def decode_s(self, seqs: int, context: int) -> float:
        return self.decode(seqs, context)

    def mixed_s(self, seqs: int, context: int, tokens: int, pairs: float) -> float:
        """A step with decodes and prefill chunks: both parts, one step's overhead."""
        if not tokens:
            return self.decode_s(seqs, context)
        if not seqs:
            return self.prefill_s(tokens, pairs)
        return (
            self.decode_s(seqs, context)
            + self.prefill_s(tokens, pairs)
            - min(self.prefill.intercept, self.decode.intercept)
        )


class CostModel(msgspec.Struct, frozen=True):
    model: str
    machine: str  # CPU model (or GPU) the steps were timed on
    block_size: int
    kv_bytes_per_token: int
    num_layers: int
    transfer_gbps: float  # KV bytes/s between workers on one host (shared memory: a copy)
    by_threads: dict[int, ThreadCosts]

    def costs(self, threads: float) -> tuple[ThreadCosts, float]:
        """The costs for a worker running on `threads` cores' worth of CPU, and the slow-down to
        apply (> 1 when it gets less than one profiled thread count's cores)."""
        have = sorted(self.by_threads)
        usable = [t for t in have if t <= threads + 1e-9]
        if usable:
            return self.by_threads[usable[-1]], 1.0
        return self.by_threads[have[0]], have[0] / max(threads, 1e-9)

    def transfer_tail_s(self, tokens: int) -> float:
        """What is left of a prompt's KV transfer after its last layer is computed (layers are
        sent as they finish: the last one's share)."""
        return tokens * self.kv_bytes_per_token / self.num_layers / (self.transfer_gbps * 1e9)


def save(model: CostModel, path: str) -> None:
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(model)))


def load(path: str) -> CostModel:
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=CostModel)
