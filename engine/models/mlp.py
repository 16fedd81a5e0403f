"""The gated MLP (SiLU(x W_gate) * x W_up) W_down, gate and up fused into one linear: a dense
layer's MLP, and each expert of a mixture (models/moe.py)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.shard import TensorParallelShard
from pdserve.kernels import layer_ops


class MLP(nn.Module):
    """Under tensor parallelism (`tp`) this rank's rows of the intermediate, summed across ranks
    at the end. `intermediate` (an expert's size) builds a whole one with no all-reduce: the
    mixture sums its experts' outputs first."""

    def __init__(
        self, cfg: ModelConfig, tp: TensorParallelGroup | None = None, intermediate: int | None = None
    ) -> None:
        super().__init__()
        if intermediate is None:
            i0, i1 = (tp.shard if tp is not None else TensorParallelShard()).intermediate(cfg)  # this rank's rows
            self.tp, self.intermediate = tp, i1 - i0
        else:
            self.tp, self.intermediate = None, intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(layer_ops.silu_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, H]
        return y if self.tp is None else self.tp.all_reduce(y)
