"""Gemma 2 and Gemma 3 (text) decoders: the Llama model (models/llama.py) with Gemma's differences.

- embedding scaled by sqrt(hidden) (the scale rounded to the model dtype, as HF does);
- RMSNorm times (1 + weight): the 1 is folded into the loaded weights (`loaded`), so the shared
  RMSNorm (and its C op) runs unchanged; in fp32 this is HF's arithmetic exactly;
- a norm after each sublayer as well as before (pre/post attention, pre/post feed-forward);
- GeLU (tanh approximation) MLP;
- attention scaled by query_pre_attn_scalar ** -0.5, scores soft-capped where configured
  (Gemma 2), q/k RMSNorm per head (Gemma 3; ModelConfig.qk_norm);
- sliding and full layers from `layer_types` (ModelConfig.layer_windows: the attention kernels
  take each layer's window); Gemma 3 rotates its sliding layers with their own (local) rope;
- final logits soft-capped where configured (Gemma 2).
Sharded for tensor parallelism as Llama is (the extra norms replicated); not run by the fused C
decode driver (its layers are Llama's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.llama import MLP, DecoderLayer, ForwardContext, LlamaForCausalLM, RMSNorm, Rope
from pdserve.engine.models.rotary import RotaryEmbedding
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.kernels import decode_layers

GemmaRopes = tuple[Rope, Rope | None]  # the full layers' tables, the sliding layers' (None: the same)


class GemmaMLP(MLP):
    """Llama's MLP (its tensor-parallel shard of the intermediate too) with GeLU-tanh for SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each (this rank's I)
        y = self.down_proj(F.gelu(gate, approximate="tanh") * up)  # [T, H]
        return y if self.tp is None else self.tp.all_reduce(y)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(cfg, layer, tp)
        self.mlp = GemmaMLP(cfg, tp)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.local = cfg.window(layer) is not None  # a sliding layer: the local rope where there is one

    def forward(self, x: torch.Tensor, rope: GemmaRopes, ctx: ForwardContext) -> torch.Tensor:  # type: ignore[override]
        full, local = rope
        attn = self.self_attn(self.input_layernorm(x), local if self.local and local is not None else full, ctx)
        x, h = self.pre_feedforward_layernorm.add_forward(x, self.post_attention_layernorm(attn))  # [T, H] each
        return x + self.post_feedforward_layernorm(self.mlp(h))


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(cfg, max_positions, tp)
        self.local_rotary = (
            RotaryEmbedding(cfg.local_rope, cfg.rotary_dims, max_positions) if cfg.local_rope is not None else None
        )

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        super().materialize(device, dtype)
        if self.local_rotary is not None:
            self.local_rotary.build_tables(device)

    @torch.no_grad()
    def loaded(self) -> None:
        """Gemma's norms scale by (1 + weight): fold the 1 in, once, after loading (a GGUF file's
        norms hold it already)."""
        if self.cfg.norms_plus_one:
            return
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(1.0)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, GemmaRopes]:  # type: ignore[override]
        x, full = super().embed(input_ids, positions)  # [T, H] (vocab-parallel under TP)
        x = x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)  # HF rounds the scale to the dtype
        local = self.local_rotary.tables(positions, x.dtype) if self.local_rotary is not None else None
        return x, (full, local)

    def head(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        logits = super().head(x, logits_indices)  # [S, V] fp32
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def describe_decode_layers(self, kv_cache: torch.Tensor) -> decode_layers.DecodeLayers | None:
        return None  # the fused driver runs Llama's layers only
