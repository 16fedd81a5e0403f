"""An embedding table kept as a GGUF file's blocks (one format: the group-wise copy, or the file's
own blocks), its rows dequantized as they are looked up (the very values the float table would hold). The
float table is never made: for a 49k vocabulary it is more than every 4-bit linear together. A
tied LM head (a QuantizedLinear of the same blocks) shares the tensors."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels import block_gemm
from pdserve.kernels.block_gemm import BlockWeight
from pdserve.kernels.quant_gemm import QuantWeight, dequantize


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantWeight | BlockWeight) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = torch.float32  # the model's, set when it gets its storage
        if isinstance(weight, BlockWeight):
            self.qtype: int | None = weight.qtype  # the file's blocks (kernels/block_gemm.py)
            self.q = nn.Parameter(weight.blocks, requires_grad=False)  # the very tensor (no copy)
            return
        self.qtype = None
        self.bits, self.scale_group = weight.bits, weight.scale_group
        self.q = nn.Parameter(weight.q, requires_grad=False)  # the very tensors (no copy)
        self.scales = nn.Parameter(weight.scales, requires_grad=False)
        self.offsets = None if weight.offsets is None else nn.Parameter(weight.offsets, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> [..., H] in the model's dtype."""
        ids = input_ids.reshape(-1)  # [T]
        if self.qtype is not None:
            rows_f32 = block_gemm.dequantize_rows(
                BlockWeight(self.qtype, self.q.data, self.embedding_dim), ids
            )  # [T, H]
            return rows_f32.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)  # [..., H]
        rows = QuantWeight(
            self.bits,
            self.q.index_select(0, ids),  # [T, bytes a row]
            self.scales.index_select(0, ids),  # [T, scales a row]
            self.embedding_dim,
            None if self.offsets is None else self.offsets.index_select(0, ids),
            self.scale_group,
        )
        return dequantize(rows).to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)  # [..., H]
