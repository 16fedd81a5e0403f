"""Writing GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K), which the gguf package reads but cannot
write: a plain min/max quantizer per sub-block (llama.cpp searches scales harder; the layout is
the same, and the gguf package's dequantization reads these blocks back). For `make-model --gguf`
(test and benchmark files of the types real users download)."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [n, 8] -> ggml's 12 bytes [n, 12] (the inverse of its get_scale_min)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    lo, hi = slice(0, 4), slice(4, 8)
    out[:, 0:4] = (sc[:, lo] & 0x3F) | ((sc[:, hi] >> 4) << 6)
    out[:, 4:8] = (mn[:, lo] & 0x3F) | ((mn[:, hi] >> 4) << 6)
    out[:, 8:12] = (sc[:, hi] & 0x0F) | ((mn[:, hi] & 0x0F) << 4)
    return out


def _affine_superblocks(w: np.ndarray, levels: int):
    """w [n, 256] -> (d, dmin fp16 [n], 6-bit scales and mins [n, 8], values [n, 256] in 0..levels)."""
    sub = w.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # [n, 8]: ggml keeps the minimum at or below zero
    hi = sub.max(-1)
    scale, minv = (hi - lo) / levels, -lo
    d, dmin = _f16(scale.max(-1) / 63), _f16(minv.max(-1) / 63)  # [n]
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(minv, dminf, out=np.zeros_like(minv), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]  # [n, 8, 1]
    shifted = sub + (dminf * mn)[..., None]
    q = np.divide(shifted, step, out=np.zeros_like(shifted), where=step > 0)
    values = np.clip(np.round(q), 0, levels).astype(np.uint8).reshape(-1, QK_K)
    return d, dmin, sc, mn, values


def _low_nibbles(values: np.ndarray) -> np.ndarray:
    """[n, 256] (low 4 bits used) -> 128 bytes: byte b of chunk c = element 64c + b | 64c + 32 + b << 4."""
    v = (values & 0x0F).reshape(-1, 4, 2, 32)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w [rows, k] (k a multiple of 256) -> Q4_K blocks [rows, k / 256 * 144] uint8."""
    rows = w.shape[0]
    d, dmin, sc, mn, values = _affine_superblocks(w.reshape(-1, QK_K).astype(np.float32), 15)
    blocks = np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
            _pack_scale_min(sc, mn),
            _low_nibbles(values),
        ],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """w [rows, k] -> Q5_K blocks [rows, k / 256 * 176] uint8 (fifth bits: bit i of byte b is
    element 32i + b's)."""
    rows = w.shape[0]
    d, dmin, sc, mn, values = _affine_superblocks(w.reshape(-1, QK_K).astype(np.float32), 31)
    high = (values >> 4).reshape(-1, 8, 32)  # [n, sub-block i, b]
    qh = np.zeros((values.shape[0], 32), dtype=np.uint8)
    for i in range(8):
        qh |= high[:, i] << i
    blocks = np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
            _pack_scale_min(sc, mn),
            qh,
            _low_nibbles(values),
        ],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w [rows, k] -> Q6_K blocks [rows, k / 256 * 210] uint8: 16 sub-blocks of 16 with int8
    scales, q - 32 in [-32, 31]."""
    rows = w.shape[0]
    sub = w.reshape(-1, 16, 16).astype(np.float32)
    s = np.abs(sub).max(-1) / 31  # [n, 16]
    d = _f16(s.max(-1) / 127)  # [n]
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(s, df, out=np.zeros_like(s), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc.astype(np.float32))[..., None]  # [n, 16, 1]
    q = np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)
    values = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [n, half, 128]
    low, high = values & 0x0F, values >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)  # byte (h, b): elements h*128 + b, + 64
    h4 = high.reshape(-1, 2, 4, 32)  # element h*128 + 32s + b
    qh = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1)
