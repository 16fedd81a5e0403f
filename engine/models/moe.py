"""A mixture of experts in place of a layer's MLP (Qwen2-MoE, Qwen3-MoE, Mixtral), as HF computes it:

    probs  = softmax(x W_router)                 [T, E], fp32
    w, e   = top-k of probs                      [T, k]  (renormalised to sum 1: norm_topk_prob)
    y      = sum over k of w * expert_e(x)       each expert a gated MLP (models/mlp.py)
    (+ sigmoid(x w_gate) * shared_expert(x))     Qwen2-MoE's always-on expert

Tokens are grouped by expert within a step: one sort of the T*k choices, then each expert hit
runs once over its rows (a decode step of one sequence: k small products; a prefill: ~T*k/E
rows each), its outputs added in ascending expert order, as HF's loop does. Experts stay
whatever their linears were loaded as: fp32/bf16, or a GGUF file's blocks as stored (each
expert's rows of the file's stacked tensor, mapped); in the latter case the whole mixture runs
in one C call (kernels/block_gemm.py `moe_routed`: x quantized once, no Python between experts). Under
tensor parallelism each rank holds whole experts (engine/parallel/shard.py), routes every token,
runs the ones it holds, and one all-reduce sums the ranks' shares.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.mlp import MLP
from pdserve.engine.models.quantized_linear import QuantizedLinear
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.shard import TensorParallelShard
from pdserve.kernels import block_gemm
from pdserve.kernels.block_gemm import BlockWeight, ExpertBlocks


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        shard = tp.shard if tp is not None else TensorParallelShard()
        self.tp = tp
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob
        self.expert_start, expert_end = shard.experts(cfg)  # this rank's experts
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router, whole on every rank
        # keyed by the expert's number in the model (its weights' names), this rank's only
        self.experts = nn.ModuleDict(
            {str(e): MLP(cfg, intermediate=cfg.expert_intermediate_size) for e in range(self.expert_start, expert_end)}
        )
        shared = cfg.shared_expert_intermediate_size > 0 and shard.rank == 0
        self.shared_expert = MLP(cfg, intermediate=cfg.shared_expert_intermediate_size) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None
        self._blocks: ExpertBlocks | None = None
        self._blocks_looked = False  # (`expert_blocks`)

    def expert_blocks(self) -> ExpertBlocks | None:
        """The experts as a GGUF file's blocks for the one-call kernel (block_gemm.moe_routed), when every
        held expert's linears are such blocks (gate | up, down; no bias); else None. Looked at once,
        at the first step (after loading)."""
        if not self._blocks_looked:
            self._blocks_looked = True
            kinds: list[list[BlockWeight | None]] = [[None] * self.num_experts for _ in range(3)]  # gate, up, down
            for e, expert in self.experts.items():
                gate_up, down = expert.gate_up_proj, expert.down_proj
                if not (isinstance(gate_up, QuantizedLinear) and isinstance(down, QuantizedLinear)):
                    return None
                parts = [*gate_up.parts, *down.parts]
                if len(parts) != 3 or gate_up.bias is not None:
                    return None
                for kind, part in zip(kinds, parts):
                    if not isinstance(part, BlockWeight):
                        return None
                    kind[int(e)] = part
            try:
                self._blocks = ExpertBlocks(*kinds)
            except ValueError:  # kinds of mixed types or shapes: the per-expert path
                return None
        return self._blocks

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k] in x's dtype, experts [T, k] int64)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)  # [T, k], [T, k]
        fused = self.expert_blocks() if x.device.type == "cpu" else None
        if fused is not None:  # every expert in one C call, the choices grouped there
            out = block_gemm.moe_routed(x.float(), fused, chosen, weights.float()).to(x.dtype)
        else:
            flat = chosen.flatten()  # [T*k]: the expert of each (token, slot)
            order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
            out = self._per_expert(x, order, flat, weights.flatten())
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _per_expert(
        self, x: torch.Tensor, order: torch.Tensor, flat: torch.Tensor, flat_weights: torch.Tensor
    ) -> torch.Tensor:
        """Each expert hit as its own modules, over its rows: [T, H]."""
        out = torch.zeros_like(x)  # [T, H]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n and str(e) in self.experts:
                pairs = order[start : start + n]  # [n]
                tokens = pairs // self.top_k  # [n], ascending (a token picks an expert once)
                y = self.experts[str(e)](x[tokens]) * flat_weights[pairs, None]  # [n, H]
                out.index_add_(0, tokens, y)
            start += n
        return out
