"""Weights into the group-wise int8 / int4 format of kernels/quant_gemm.py: from float values
(`--quantization`), or from a GGUF file's blocks as they are stored (`from_gguf_blocks`: Q8_0,
Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; the values are ggml's dequantization's, to the bit).

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


Q = gguf.GGMLQuantizationType
KEPT_GGUF_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # kept as stored; others dequantized


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] fp32 (fp16 widened: exact)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes [n, 12] -> 6-bit scales and mins [n, 8] (ggml's packing)."""
    d, m, m_d = np.split(packed.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8), mn.reshape(-1, 8)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes [n, 128] -> 256 values [n, 256]: byte b of 32-byte chunk c holds
    element 64c + b (low nibble) and 64c + 32 + b (high)."""
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 256)


def _unpack(blocks: np.ndarray, qtype: gguf.GGMLQuantizationType):
    """Blocks [n, bytes] -> (values [n, per block] (int8 or 0..15), scales [n, S], offsets [n, S]
    or None, scale_group): w = values * scales (+ offsets), element by element, as ggml has it."""
    if qtype == Q.Q8_0:
        return blocks[:, 2:].view(np.int8), _f16(blocks[:, :2])[:, None], None, 32
    if qtype in (Q.Q4_0, Q.Q4_1):
        head = 2 if qtype == Q.Q4_0 else 4
        nib = blocks[:, head:]  # [n, 16]: element j low, j + 16 high
        values = np.concatenate([nib & 0x0F, nib >> 4], axis=1)  # [n, 32]
        if qtype == Q.Q4_0:
            return values.astype(np.int8) - 8, _f16(blocks[:, :2])[:, None], None, 32
        return values, _f16(blocks[:, :2])[:, None], _f16(blocks[:, 2:4])[:, None], 32
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, mn = _k_scale_min(blocks[:, 4:16])
        if qtype == Q.Q4_K:
            values = _k_low_nibbles(blocks[:, 16:144])
        else:  # 32 bytes of high bits: bit i of byte b is element b of sub-block i's fifth bit
            qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            values = _k_low_nibbles(blocks[:, 48:176]) | ((qh & 1).reshape(-1, 256) << 4)
        return values, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 32
    if qtype == Q.Q6_K:
        ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _f16(blocks[:, 208:210])
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
        values = (low.reshape(-1, 256) | (high.reshape(-1, 256) << 4)).astype(np.int8) - 32
        return values, d[:, None] * scales.view(np.int8).astype(np.float32), None, 16
    raise ValueError(
        f"GGUF type {qtype.name} is not kept quantized (kept: {', '.join(t.name for t in KEPT_GGUF_TYPES)})"
    )


def from_gguf_blocks(rows: np.ndarray, qtype: gguf.GGMLQuantizationType, n_in: int) -> QuantWeight:
    """A GGUF tensor's raw blocks [out, bytes] (rows in HF order; one of KEPT_GGUF_TYPES) -> the
    same values in our format: fp16 scales widened to fp32 (and multiplied by a K-quant's 6- or
    8-bit sub-block scale, in fp32 as ggml does), quants unpacked to int8 (Q5_K, Q6_K, Q8_0) or
    repacked as nibbles (Q4_*). int4 affine (Q4_1, Q4_K) keeps the nibble; Q5_K its 5-bit value."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    out = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(-1, block_bytes)  # [out * blocks a row, bytes]
    values, scales, offsets, sg = _unpack(blocks, qtype)
    values = values.reshape(out, -1)  # [out, padded_in]
    as_scales = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(out, -1))  # noqa: E731
    off = None if offsets is None else as_scales(offsets)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        v = values.astype(np.uint8) if qtype != Q.Q4_0 else (values + 8).astype(np.uint8)  # nibbles 0..15
        g = v.reshape(out, -1, 2, 16)  # [out, G, halves, 16]
        packed = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(out, -1)  # [out, G * 16]: ours
        return QuantWeight(4, torch.from_numpy(np.ascontiguousarray(packed)), as_scales(scales), n_in, off, sg)
    q = torch.from_numpy(np.ascontiguousarray(values.astype(np.int8)))  # [out, padded_in]
    assert block_elems % 32 == 0
    return QuantWeight(8, q, as_scales(scales), n_in, off, sg)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Weights of one format stacked along out (q | k | v, gate | up)."""
    first = parts[0]
    assert all(same_format(p, first) and p.in_features == first.in_features for p in parts)
    q = torch.cat([p.q for p in parts])  # [sum out, ...]
    offsets = None if first.offsets is None else torch.cat([p.offsets for p in parts if p.offsets is not None])
    return QuantWeight(
        first.bits, q, torch.cat([p.scales for p in parts]), first.in_features, offsets, first.scale_group
    )


def same_format(a: QuantWeight, b: QuantWeight) -> bool:
    """Whether two weights' rows can stack into one (bits, scale group, affine or not)."""
    return (a.bits, a.scale_group, a.affine) == (b.bits, b.scale_group, b.affine)
