"""One layer's KV blocks copied between two GPU pools in one Triton launch: each block's K and V
read once and written once, from any source block to any destination block (a gather and a
scatter in one pass; torch needs an `index_select` into a buffer and an `index_copy_` out of it).

    src layer [2, Ns, bs, H, D] -> dst layer [2, Nd, bs, H, D], both contiguous:
      program (i, half, chunk): elements [chunk * BLOCK, (chunk + 1) * BLOCK) of block
      src_ids[i]'s K (half 0) or V (half 1) -> the same elements of block dst_ids[i]

dtype-agnostic (the bytes move as they are). Imports triton; kvtransfer/cuda_ipc_sender.py
calls it for CUDA pools (kernels/ holds the model's kernels; this one is KV movement's own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, src_half, dst_half, block_elems, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    half = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] elements of the block's K or V
    mask = offs < block_elems
    x = tl.load(src_ptr + half * src_half + s * block_elems + offs, mask=mask)
    tl.store(dst_ptr + half * dst_half + d * block_elems + offs, x, mask=mask)


def takes(dst_layer: torch.Tensor, src_layer: torch.Tensor) -> bool:
    """Two contiguous layers [2, N, bs, H, D] of one dtype and block shape on one device."""
    return (
        dst_layer.dim() == src_layer.dim() == 5
        and dst_layer.shape[0] == src_layer.shape[0] == 2
        and dst_layer.shape[2:] == src_layer.shape[2:]
        and dst_layer.dtype == src_layer.dtype
        and dst_layer.device == src_layer.device
        and dst_layer.is_contiguous()
        and src_layer.is_contiguous()
    )


def copy_blocks(dst_layer: torch.Tensor, dst_ids: torch.Tensor, src_layer: torch.Tensor, src_ids: torch.Tensor) -> None:
    """dst_layer[:, dst_ids] = src_layer[:, src_ids]; ids [n] int32/int64 on the layers' device,
    checked by the caller (in range, destinations distinct)."""
    n = int(dst_ids.numel())
    if n == 0:
        return
    block_elems = src_layer[0, 0].numel()  # bs * H * D
    grid = (n, 2, triton.cdiv(block_elems, ELEMENTS_PER_PROGRAM))
    _copy_blocks_kernel[grid](
        src_layer,
        dst_layer,
        src_ids,
        dst_ids,
        src_layer.shape[1] * block_elems,
        dst_layer.shape[1] * block_elems,
        block_elems,
        BLOCK=ELEMENTS_PER_PROGRAM,
    )
