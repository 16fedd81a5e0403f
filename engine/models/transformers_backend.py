"""Any decoder-only model through transformers' own modelling code (`--model-impl transformers`,
or `auto` where no native path exists), with pdserve's paged KV cache plugged in as its attention
(models/transformers_attention.py). Slower than the native path (no fused ops, no C decode
driver), exact where transformers is: the model is transformers' class with the folder's weights.

The runner's stages map onto the HF model like this (the ragged flat step runs as batch 1):

    embed:  the HF base model's own forward up to its first decoder layer (embedding, its
            multipliers, rotary tables for `position_ids` = the step's positions), captured by a
            forward pre-hook on layer 0 -> x [T, H] and the keyword arguments every layer gets
            (the hook captures only on the thread that is embedding: prefill lanes run layers of
            other steps on other threads meanwhile)
    layers: each HF decoder layer called with x[None] and those arguments; the step's
            ForwardContext and the layer's index wait for its attention call in a StepSlot (per thread)
    head:   the base model's final norm, the output embeddings, and the config's logit scaling
            (`logits_scaling`, `logit_scale`, `final_logit_softcapping`)
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, cast

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.llama import ForwardContext
from pdserve.engine.models.transformers_attention import (
    ATTN_IMPLEMENTATION,
    SLOT_ATTR,
    LayerStep,
    StepSlot,
    register,
)
from pdserve.kernels import decode_layers

log = logging.getLogger(__name__)

LayerKwargs = dict[str, Any]
_FINAL_NORM_NAMES = ("norm", "final_layer_norm", "final_layernorm", "ln_f", "norm_f")


class _Captured(Exception):
    """Raised by layer 0's pre-hook to stop the base model's forward there (see `embed`)."""

    def __init__(self, hidden: torch.Tensor, kwargs: LayerKwargs) -> None:
        super().__init__("captured the first decoder layer's inputs")
        self.hidden, self.kwargs = hidden, kwargs


class _CaptureSwitch(threading.local):
    """On while this thread's `embed` runs the base model up to its first layer."""

    on: bool = False


def _capture_hook(switch: _CaptureSwitch) -> Callable[[nn.Module, tuple[Any, ...], LayerKwargs], None]:
    def capture(module: nn.Module, args: tuple[Any, ...], kwargs: LayerKwargs) -> None:
        if not switch.on:
            return
        if len(args) > 1:
            raise ValueError("this model passes its decoder layers positional arguments beyond the hidden states")
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        raise _Captured(hidden, kwargs)

    return capture


class TransformersLayer(nn.Module):
    """One HF decoder layer as the runner calls it: (x [T, H], LayerKwargs, ctx) -> [T, H]."""

    def __init__(self, hf_layer: nn.Module, index: int, slot: StepSlot) -> None:
        super().__init__()
        self.hf_layer = hf_layer
        self.index = index
        self.slot = slot
        for module in hf_layer.modules():  # the attention function finds the step through its module
            object.__setattr__(module, SLOT_ATTR, slot)

    def forward(self, x: torch.Tensor, layer_kwargs: LayerKwargs, ctx: ForwardContext) -> torch.Tensor:
        step = self.slot.step = LayerStep(ctx, self.index)
        try:
            out = self.hf_layer(x.unsqueeze(0), **layer_kwargs)
        finally:
            self.slot.step = None
        if not step.attended:
            raise RuntimeError(
                f"{type(self.hf_layer).__name__} {self.index} did not attend through transformers' "
                "AttentionInterface, so it never read pdserve's paged KV cache"
            )
        hidden = out[0] if isinstance(out, tuple) else out  # older layers return (hidden, ...)
        return hidden[0]  # [T, H]


class TransformersCausalLM(nn.Module):
    """A transformers `*ForCausalLM` behind the runner's model interface (models/interface.py)."""

    def __init__(self, hf_model: nn.Module, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.hf_model = hf_model
        self.base = cast(nn.Module, getattr(hf_model, "base_model"))
        hf_layers = _decoder_layers(self.base, cfg.num_layers)
        self.hf_layers = hf_layers
        slot = StepSlot()
        self.layers = nn.ModuleList(TransformersLayer(layer, i, slot) for i, layer in enumerate(hf_layers))
        self.capturing = _CaptureSwitch()
        hf_layers[0].register_forward_pre_hook(_capture_hook(self.capturing), with_kwargs=True)
        self.final_norm = _final_norm(self.base)
        self.lm_head = cast(nn.Module, hf_model.get_output_embeddings())  # type: ignore[operator]
        hf_cfg = getattr(hf_model, "config")
        self.logits_divisor = float(getattr(hf_cfg, "logits_scaling", None) or 1.0)  # Granite
        self.logits_factor = float(getattr(hf_cfg, "logit_scale", None) or 1.0)  # Cohere
        self.logits_softcap: float | None = getattr(hf_cfg, "final_logit_softcapping", None)  # Gemma 2

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, LayerKwargs]:
        """input_ids/positions [T] -> x [T, H] as layer 0 gets it, and what every layer gets."""
        self.capturing.on = True
        try:
            self.base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        except _Captured as got:
            return got.hidden[0], got.kwargs  # [T, H]
        finally:
            self.capturing.on = False
        raise RuntimeError(f"{type(self.base).__name__} never called its first decoder layer")

    def head(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] -> logits [S, V] for the S rows in `logits_indices`."""
        h = self.final_norm(x[logits_indices])  # [S, H]; the norm is per token, so select first
        logits = self.lm_head(h).float()  # [S, V]
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        if self.logits_factor != 1.0:
            logits = logits * self.logits_factor
        if self.logits_softcap:
            logits = torch.tanh(logits / self.logits_softcap) * self.logits_softcap
        return logits

    def describe_decode_layers(self, kv_cache: torch.Tensor) -> decode_layers.DecodeLayers | None:
        return None  # the C decode driver knows the native layers only

    def fused_decode(
        self, stack: decode_layers.DecodeLayers, x: torch.Tensor, rope: LayerKwargs, ctx: ForwardContext
    ) -> torch.Tensor | None:
        return None

    def use_cpu_weight_layout(self) -> str:
        return "torch (transformers modelling code, weights as loaded)"


def _decoder_layers(base: nn.Module, num_layers: int) -> list[nn.Module]:
    """The base model's decoder layers: its ModuleList of `num_layers` modules."""
    for name, child in base.named_children():
        if isinstance(child, nn.ModuleList) and len(child) == num_layers:
            return list(child)
    raise ValueError(f"{type(base).__name__} has no list of {num_layers} decoder layers")


def _final_norm(base: nn.Module) -> nn.Module:
    for name in _FINAL_NORM_NAMES:
        norm = getattr(base, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise ValueError(f"{type(base).__name__}: no final norm found (looked for {', '.join(_FINAL_NORM_NAMES)})")


def load_transformers_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> TransformersCausalLM:
    """transformers' class for the folder, its safetensors weights (every tensor used, none
    missing), and pdserve's paged attention as its attention implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pdserve.engine.weights import WeightLoadError

    register()
    hf_cfg = AutoConfig.from_pretrained(cfg.path, local_files_only=True)
    if hf_cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{cfg.path}: transformers has no AutoModelForCausalLM class for model_type {hf_cfg.model_type!r}"
        )
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        cfg.path,
        config=hf_cfg,
        dtype=dtype,
        attn_implementation=ATTN_IMPLEMENTATION,
        use_safetensors=True,
        local_files_only=True,
        output_loading_info=True,
    )
    hf_model, info = cast(tuple[nn.Module, dict[str, Any]], loaded)
    leftovers = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if leftovers:
        raise WeightLoadError(f"{cfg.path}: weights do not match {type(hf_model).__name__}: {leftovers}")
    not_causal = [n for n, m in hf_model.named_modules() if getattr(m, "is_causal", True) is False]
    if not_causal:
        raise ValueError(
            f"{type(hf_model).__name__} has non-causal attention ({not_causal[0]}); pdserve serves causal decoders"
        )
    log.info("%s: serving %s through transformers' modelling code", cfg.path, type(hf_model).__name__)
    model = TransformersCausalLM(hf_model.to(device).eval(), cfg)
    _probe(model, dtype, device)
    return model


@torch.inference_mode()
def _probe(model: TransformersCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """One token through every layer on a scratch one-block KV pool, at load: a model whose
    layers do not attend through the AttentionInterface, or whose KV shape differs from the
    ModelConfig's, fails now rather than at its first request."""
    from pdserve.kernels import AttentionMetadata

    c = model.cfg
    kv = torch.zeros(
        c.num_layers, 2, 1, 1, c.num_kv_heads, c.head_dim, dtype=dtype, device=device
    )  # [L, 2, N, bs, Hkv, D]
    meta = AttentionMetadata.build([1], [1], [[0]], num_decode_seqs=1, device=device)
    ctx = ForwardContext(meta, torch.zeros(1, dtype=torch.int64, device=device), kv)
    token = torch.zeros(1, dtype=torch.int64, device=device)
    try:
        x, layer_kwargs = model.embed(token, token)
        for layer in model.layers:
            x = layer(x, layer_kwargs, ctx)
        model.head(x, torch.zeros(1, dtype=torch.int64, device=device))
    except RuntimeError as why:
        raise ValueError(
            f"{c.path}: {type(model.hf_model).__name__} cannot run on pdserve's paged KV cache: {why}"
        ) from None
