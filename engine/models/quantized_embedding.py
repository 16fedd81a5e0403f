"""An embedding table kept as a GGUF file's blocks (one format), its rows dequantized as they are
looked up (kernels/quant_gemm.py `dequantize`: the very values the float table would hold). The
float table is never made: for a 49k vocabulary it is more than every 4-bit linear together. A
tied LM head (a QuantizedLinear of the same blocks) shares the tensors."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.quant_gemm import QuantWeight, dequantize


class QuantizedEmbedding(nn.Module):
    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.bits, self.scale_group = weight.bits, weight.scale_group
        self.q = nn.Parameter(weight.q, requires_grad=False)  # the very tensors (no copy)
        self.scales = nn.Parameter(weight.scales, requires_grad=False)
        self.offsets = None if weight.offsets is None else nn.Parameter(weight.offsets, requires_grad=False)
        self.dtype = torch.float32  # the model's, set when it gets its storage

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> [..., H] in the model's dtype."""
        ids = input_ids.reshape(-1)  # [T]
        rows = QuantWeight(
            self.bits,
            self.q.index_select(0, ids),  # [T, bytes a row]
            self.scales.index_select(0, ids),  # [T, scales a row]
            self.embedding_dim,
            None if self.offsets is None else self.offsets.index_select(0, ids),
            self.scale_group,
        )
        return dequantize(rows).to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)  # [..., H]
