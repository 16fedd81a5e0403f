"""Request arrival times: Poisson (burstiness 1) or gamma-distributed gaps; rate inf = one burst."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    # Gamma(shape=k, scale=1/(rate*k)) has mean 1/rate; k=1 is exponential (Poisson arrivals).
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
