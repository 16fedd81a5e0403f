"""Random GGUF blocks for kernel tests and benchmarks: every bit pattern in the quantized values
and packed scales (negative Q6_K scales, Q8_0's -128 included), with each block's fp16 fields set
to finite, moderate values (about 1/64, either sign), so products stay finite."""

from __future__ import annotations

import gguf
import numpy as np

FP16_FIELDS = {  # byte offsets, within one ggml block, of its fp16 fields (d, dmin / m)
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, n_in: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, n_in / block elements * block bytes]: a weight's rows as a GGUF file stores them."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * n_in // elems, nbytes), dtype=np.uint8)  # [blocks, bytes]
    for off in FP16_FIELDS[qtype.name]:
        d = rng.uniform(0.5, 1.5, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0]) / 64
        blocks[:, off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
