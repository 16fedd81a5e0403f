"""Weights into the group-wise int8 / int4 format of kernels/quant_gemm.py: from float values
(`--quantization`), or from a GGUF file's Q8_0 / Q4_0 blocks as they are stored.

Both schemes are symmetric with groups of 32 inputs and an fp32 scale, the rules of llama.cpp's
Q8_0 and Q4_0 (so a GGUF file's blocks and our own quantization land in one format):
- int8: d = max|w| / 127, q = round(w / d) in [-127, 127];
- int4: d = m / -8 where m is the group's value of largest magnitude (sign kept), q =
  clamp(floor(w / d + 8.5), 0, 15) stored as nibbles, w = (q - 8) * d: m itself maps to -8
  exactly and the other side reaches +7.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from pdserve.kernels.quant_gemm import BITS, GROUP, QuantWeight

SCHEMES = tuple(BITS)  # int8, int4
GGUF_TYPES = {"int8": gguf.GGMLQuantizationType.Q8_0, "int4": gguf.GGMLQuantizationType.Q4_0}


def quantize(weight: torch.Tensor, scheme: str) -> QuantWeight:
    """A float weight [out, in] -> `scheme` (int8 or int4), rows zero-padded to whole groups."""
    out, n_in = weight.shape
    w = F.pad(weight.detach().float(), (0, -n_in % GROUP)).view(out, -1, GROUP)  # [out, G, 32]
    if scheme == "int8":
        d = w.abs().amax(dim=-1) / 127  # [out, G]
        inv = torch.where(d > 0, 1 / d, 0).unsqueeze(-1)
        q = torch.round(w * inv).clamp(-127, 127).to(torch.int8).reshape(out, -1)  # [out, G * 32]
    elif scheme == "int4":
        idx = w.abs().argmax(dim=-1, keepdim=True)
        d = (w.gather(-1, idx) / -8).squeeze(-1)  # [out, G]
        inv = torch.where(d != 0, 1 / d, 0).unsqueeze(-1)
        n = torch.floor(w * inv + 8.5).clamp(0, 15).to(torch.uint8)  # [out, G, 32]
        q = (n[..., :16] | (n[..., 16:] << 4)).reshape(out, -1)  # [out, G * 16]
    else:
        raise ValueError(f"unknown quantization {scheme!r}; choose {', '.join(SCHEMES)}")
    return QuantWeight(BITS[scheme], q.contiguous(), d.float().contiguous(), n_in)


def from_gguf_blocks(rows: np.ndarray, qtype: gguf.GGMLQuantizationType, n_in: int) -> QuantWeight:
    """A GGUF tensor's raw Q8_0 / Q4_0 blocks [out, bytes] (rows in HF order) -> the same values
    in our format: the fp16 scales widened to fp32 (exact), the quants copied as they are."""
    block_bytes = {gguf.GGMLQuantizationType.Q8_0: 34, gguf.GGMLQuantizationType.Q4_0: 18}[qtype]
    out = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(out, -1, block_bytes)  # [out, G, 2 + quants]
    scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))  # [out, G]
    quants = torch.from_numpy(blocks[..., 2:].copy()).reshape(out, -1)  # uint8 [out, G * 32 or G * 16]
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        return QuantWeight(8, quants.view(torch.int8), scales, n_in)
    return QuantWeight(4, quants, scales, n_in)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Weights of one format stacked along out (q | k | v, gate | up)."""
    first = parts[0]
    assert all(p.bits == first.bits and p.in_features == first.in_features for p in parts)
    q = torch.cat([p.q for p in parts])  # [sum out, ...]
    return QuantWeight(first.bits, q, torch.cat([p.scales for p in parts]), first.in_features)
