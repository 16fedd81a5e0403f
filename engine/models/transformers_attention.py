"""pdserve's paged KV cache as a transformers attention implementation (`AttentionInterface`).

transformers' attention modules project q/k/v, apply their rotary (full, partial, with q/k norms:
the model's own code), then call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`. Ours,
registered as ATTN_IMPLEMENTATION, gets each layer's q/k/v of the whole ragged step as batch 1,
stores k/v into the layer's paged pool at the step's slots, tells the prefill worker the layer is
stored, and attends over the pool with `kernels.paged_attention` (causal, per sequence).

The step's ForwardContext and the layer index come from the StepSlot the attention module
carries (models/transformers_backend.py fills it around each layer call): not every model passes
keyword arguments down from its decoder layers to the attention call (StableLM does not).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.models.llama import ForwardContext
from pdserve.kernels import kv_quant

ATTN_IMPLEMENTATION = "pdserve_paged"
SLOT_ATTR = "pdserve_slot"  # set on every module of the decoder layers (models/transformers_backend.py)


@dataclass
class LayerStep:
    """One layer's part of a step, for its attention call (which marks it `attended`, so a layer
    whose model computes attention its own way is caught, not served wrong)."""

    ctx: ForwardContext
    layer: int
    attended: bool = False


class StepSlot(threading.local):
    """Where a model's attention modules find the layer step they run in: set around each layer
    call, per thread (prefill lanes run layers of different steps on their own threads at once)."""

    step: LayerStep | None = None


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] (after rotary) -> ([1, T, Hq, D], no weights)."""
    slot: StepSlot | None = getattr(module, SLOT_ATTR, None)
    step = None if slot is None else slot.step
    if step is None:
        raise RuntimeError(f"{type(module).__name__} attended outside a decoder layer's step")
    _refuse_what_the_kernels_cannot_do(module, kwargs)
    ctx, layer = step.ctx, step.layer
    if step.attended:
        raise RuntimeError(f"layer {layer} attended twice in one step")
    step.attended = True
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    kv_layer = ctx.kv_cache[layer]  # [2, N, bs, Hkv, D] (int8, fp8 rows: D + 4)
    pool_heads = (kv_layer.shape[-2], kv_quant.head_dim(kv_layer))
    if tuple(k.shape[1:]) != pool_heads:
        raise ValueError(f"layer {layer}: KV heads x head dim {tuple(k.shape[1:])} != the KV pool's {pool_heads}")
    kernels.store_kv(k, v, kv_layer, ctx.slot_mapping)
    if ctx.on_layer_stored is not None:
        ctx.on_layer_stored(layer)
    scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
    out = kernels.paged_attention(q, k, v, kv_layer, ctx.attn, scale)  # [T, Hq, D]
    return out.unsqueeze(0), None  # [1, T, Hq, D]


def _refuse_what_the_kernels_cannot_do(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """The paged kernels attend causally with one scale and nothing else; any other variant the
    layer asks for is refused rather than served inexactly. A sliding window is honoured by
    ModelConfig capping every sequence at it (then the window never cuts anything)."""
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} is not causal; the paged kernels attend causally only")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} asks for attention {name!r}, which the paged kernels do not do")


def null_mask(*args: Any, **kwargs: Any) -> None:
    """The mask transformers would build: none, the paged kernels mask causally per sequence."""
    return None


def register() -> None:
    """Make ATTN_IMPLEMENTATION known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, null_mask)
