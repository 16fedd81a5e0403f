"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) over a paged KV cache and ragged
batches. What the families change is in the config: qkv/o biases, Qwen3's q/k norm
(models/qk_norm.py), partial rotary and RoPE scaling (models/rotary.py), per-layer sliding
windows (Mistral, Qwen2). Gemma 2/3 (models/gemma.py) subclass this with their own layers.

Input is a flat ragged batch of T tokens (no padding); attention reads/writes the paged pool
through `kernels`. Linear layers are fused (qkv, gate_up) -- `engine.weights` maps HF names.

Under tensor parallelism (`tp`, engine/parallel/) each rank builds only its shard
(engine/parallel/shard.py): its q and KV heads, its MLP rows, its vocabulary rows; o_proj and
down_proj end in one all-reduce each, the embedding in one, and the LM head gathers the logits
to rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, cast

import torch
from torch import nn

from pdserve import kernels
from pdserve.engine.config import ModelConfig
from pdserve.engine.models.cpu_linear import PackedLinear, cpu_linear_kind, gemv_copy_fits, relayout_linears
from pdserve.engine.models.mlp import MLP
from pdserve.engine.models.moe import SparseMoeBlock
from pdserve.engine.models.qk_norm import norm_qk_heads
from pdserve.engine.models.quantized_embedding import QuantizedEmbedding
from pdserve.engine.models.quantized_linear import QuantizedLinear, few_rows
from pdserve.engine.models.rotary import RotaryEmbedding, rotate
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.shard import TensorParallelShard
from pdserve.kernels import decode_layers, layer_ops, panel_gemm, quant_gemm


@dataclass
class ForwardContext:
    """Per-step inputs shared by all layers."""

    attn: kernels.AttentionMetadata
    slot_mapping: torch.Tensor  # [T] int64
    kv_cache: torch.Tensor  # [L, 2, N, bs, Hkv, D]
    # Called after layer l stored its KV (prefill workers stream KV from here).
    on_layer_stored: Callable[[int], None] | None = None


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, R]: this step's tokens, shared by every layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_ops.rms_norm(x, self.weight, self.eps)  # [T, H]

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before the norm, fused: (x + delta, norm(x + delta)), both [T, H]."""
        return layer_ops.add_rms_norm(x, delta, self.weight, self.eps)


def _shard(tp: TensorParallelGroup | None) -> TensorParallelShard:
    return tp.shard if tp is not None else TensorParallelShard()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        (h0, h1), (k0, k1) = _shard(tp).heads(cfg), _shard(tp).kv_heads(cfg)  # this rank's heads
        self.num_heads, self.num_kv_heads, self.head_dim = h1 - h0, k1 - k0, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.window, self.softcap = cfg.window(layer), cfg.attn_softcap  # None: full attention, no capping
        self.eps = cfg.rms_norm_eps
        self.full_rotary = cfg.rotary_dims == cfg.head_dim
        self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2Hkv) * D]
        if self.q_norm is not None and self.k_norm is not None:
            qkv = norm_qk_heads(
                qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.num_kv_heads, self.head_dim, self.eps
            )
        kv_layer = ctx.kv_cache[self.layer]  # [2, N, bs, Hkv, D]
        fused = None
        if self.full_rotary:  # the C op rotates whole heads
            fused = layer_ops.rope_store(qkv, *rope, self.num_heads, self.num_kv_heads, kv_layer, ctx.slot_mapping)
        if fused is not None:  # C: rotate q, k and store k, v in one pass
            q, k, v = fused  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim)  # [T, Hq + Hkv, D]
            v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            q, k = rotate(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)  # q and k in one go
            kernels.store_kv(k, v, kv_layer, ctx.slot_mapping)
        if ctx.on_layer_stored is not None:
            ctx.on_layer_stored(self.layer)
        out = kernels.paged_attention(q, k, v, kv_layer, ctx.attn, self.scale, self.window, self.softcap)  # [T, Hq, D]
        y = self.o_proj(out.reshape(T, self.q_size))  # [T, H]: this rank's heads' share
        return y if self.tp is None else self.tp.all_reduce(y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(cfg, tp) if cfg.moe_layer(layer) else MLP(cfg, tp)

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(self.input_layernorm(x), rope, ctx))
        return x + self.mlp(h)


def _driver_rows(module: nn.Module) -> int:
    """The most rows a step may have for this linear's kernel in the driver to be the per-op
    path's own: the panel GEMM's `few_rows()`, or the quantized GEMM's limit for each part's bits."""
    if isinstance(module, QuantizedLinear):
        return min(few_rows(p) for p in module.parts)
    return panel_gemm.few_rows()


def _driver_norm(weight: torch.Tensor) -> bool:
    """Whether the driver's RMSNorm takes this weight as the per-op path's does (fp32, contiguous)."""
    return weight.dtype == torch.float32 and weight.is_contiguous()


def _driver_linear(module: nn.Module, keep: list) -> decode_layers.LinearDesc | None:
    """One linear as the decode driver takes it: fp32 few-row panels (PackedLinear) or quantized
    row segments (QuantizedLinear; their ctypes array appended to `keep`); None when neither."""
    if isinstance(module, PackedLinear) and module.panels is not None:
        return decode_layers.panel_linear(module.panels, module.bias)
    if isinstance(module, QuantizedLinear) and decode_layers.quantized_available():
        got = decode_layers.quant_linear(module.parts, module.bias, module.int8_activations)
        if got is not None:
            keep.append(got[1])
            return got[0]
    return None


class LlamaForCausalLM(nn.Module):
    decoder_layer: type[DecoderLayer] = DecoderLayer  # a family with other layers (models/gemma.py) sets its own

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.shard = _shard(tp)
        self.shard.check(cfg)
        self.vocab_start, vocab_end = self.shard.vocab(cfg)  # this rank's rows of the vocabulary
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dims, max_positions)
        self.embed_tokens: nn.Embedding | QuantizedEmbedding = nn.Embedding(
            vocab_end - self.vocab_start, cfg.hidden_size
        )
        self.layers = nn.ModuleList(self.decoder_layer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_end - self.vocab_start, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers`, typed (an nn.ModuleList yields plain Modules)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Give a meta-built model real (uninitialised) storage; weights come from the loader.
        Tensors already real (linears kept as a GGUF file's blocks, built before: their bias
        stays fp32, as the quantized kernel takes it) are left as they are."""
        for module in self.modules():
            keep_fp32 = isinstance(module, QuantizedLinear)
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_meta:
                    want = p.dtype if not p.is_floating_point() else torch.float32 if keep_fp32 else dtype
                    setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=want, device=device), False))
        embed = self.embed_tokens
        if isinstance(embed, QuantizedEmbedding):  # a GGUF file's blocks: rows out in our dtype
            embed.dtype = dtype
        elif self.cfg.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # tie the new parameters
            self.lm_head.weight = embed.weight
        self.rotary.build_tables(device)  # kept in fp32 whatever the model dtype

    def loaded(self) -> None:
        """Called once the weights are loaded, before any relayout (Gemma folds its norm offsets)."""

    def use_cpu_weight_layout(self) -> str:
        """CPU layout (after loading): linear weights prepacked for oneDNN, or stored [in, out]
        where it is unavailable (see engine/models/cpu_linear.py); returns which. A tied LM
        head gets its own copy of the embedding table (the lookup needs the [V, H] rows):
        vocab x hidden more memory, for a decode step that reads it at GEMM speed."""
        dtype = self.norm.weight.dtype  # the model's
        kind = cpu_linear_kind(dtype)
        gemv_copy = (kind == "packed" or dtype == torch.bfloat16) and gemv_copy_fits(self)
        relayout_linears(self, kind, gemv_copy)
        return kind + (" (+ copies for few-row steps)" if gemv_copy else "")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """input_ids/positions [T] -> logits [S, V] for the S rows in `logits_indices`."""
        x, rope = self.embed(input_ids, positions)
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return self.head(x, logits_indices)

    def describe_decode_layers(self, kv_cache: torch.Tensor) -> decode_layers.DecodeLayers | None:
        """The layers over this KV pool [L, 2, N, bs, Hkv, D], described once for the one-call
        decode driver (kernels/decode_layers.py); None when it cannot run them: not the fp32 CPU
        path (the pool fp32, or int8 or fp8 rows), a layer the driver does not know (partial rotary, o_proj bias), a linear
        it cannot take (neither few-row panels nor quantized segments without input padding:
        models/quantized_linear.py), or the driver not built, or tensor parallelism (the driver
        has no all-reduce between layers), or a sliding window or soft-capping (the driver
        attends over the whole context), or a mixture of experts."""
        if self.tp is not None:
            return None
        pool_dtypes = (torch.float32, torch.int8, torch.uint8)  # int8, uint8: --kv-cache-dtype int8|fp8
        if not (kv_cache.device.type == "cpu" and kv_cache.dtype in pool_dtypes and kv_cache.is_contiguous()):
            return None
        if self.decoder_layers[0].input_layernorm.weight.dtype != torch.float32:  # (a quantized pool under bf16)
            return None
        c = self.cfg
        if c.rotary_dims != c.head_dim or c.o_bias or c.layer_windows or c.attn_softcap or c.num_experts:
            return None
        if not decode_layers.available():
            return None
        described: list[decode_layers.LayerWeights] = []
        keep: list = []  # the quantized segments' ctypes arrays, alive as long as the layers
        # lowered to the tightest linear's limit below
        max_rows = max(panel_gemm.few_rows(), *quant_gemm.FEW_ROWS.values())
        for i, layer in enumerate(self.decoder_layers):
            attn, mlp = layer.self_attn, cast(MLP, layer.mlp)  # (no mixture reaches here)
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            linears = [_driver_linear(m, keep) for m in modules]
            if any(lin is None for lin in linears):
                return None
            max_rows = min(max_rows, *(_driver_rows(m) for m in modules))
            qkv, o, gate_up, down = cast(list[decode_layers.LinearDesc], linears)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)  # fp32 with the panels
            qk = (attn.q_norm, attn.k_norm)  # Qwen3's per-head norms, or None
            if any(n is not None and not _driver_norm(n.weight) for n in qk):
                return None
            described.append(
                decode_layers.LayerWeights(
                    norms[0].data_ptr(),
                    norms[1].data_ptr(),
                    qkv,
                    o,
                    gate_up,
                    down,
                    kv_cache[i].data_ptr(),
                    *(None if n is None else n.weight.data_ptr() for n in qk),
                )
            )
        shape = decode_layers.StackShape(
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            kv_cache.shape[3],
            c.rms_norm_eps,
            c.head_dim**-0.5,
        )
        return decode_layers.DecodeLayers(described, kv_cache, shape, keep, max_rows)

    @staticmethod
    def fused_decode(
        stack: decode_layers.DecodeLayers, x: torch.Tensor, rope: Rope, ctx: ForwardContext
    ) -> torch.Tensor | None:
        """Every layer in one C call (`stack`, from `describe_decode_layers`) for a step of up to
        `stack.max_rows` decodes (fp32: the panel GEMM's `few_rows()`; quantized: the quantized GEMM's row limit)
        with no per-layer callback: x [T, H] -> [T, H]. None when the step is not such a one, or
        the driver is switched off (the caller runs the layers one by one)."""
        attn = ctx.attn
        if not (
            0 < x.shape[0] <= stack.max_rows
            and attn.num_decode_seqs == attn.num_seqs == x.shape[0]
            and ctx.on_layer_stored is None
            and decode_layers.enabled()
        ):
            return None
        cos, sin = rope
        return stack.run(x, cos, sin, ctx.slot_mapping, attn.block_tables, attn.context_lens)

    # The pass in stages, for callers that run it a layer at a time (prefill lanes).
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Rope]:
        """input_ids/positions [T] -> hidden states [T, H] and this step's rotary tables."""
        if self.tp is None:
            x = self.embed_tokens(input_ids)  # [T, H]
        else:  # vocab-parallel: each rank looks up the ids in its rows, zeros elsewhere, summed
            local = input_ids - self.vocab_start  # [T]
            mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)  # [T]
            x = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))  # [T, H]
            x = self.tp.all_reduce(x * mine.unsqueeze(1).to(x.dtype))  # [T, H]
        return x, self.rotary.tables(positions, x.dtype)

    def head(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] -> logits [S, V] for the S rows in `logits_indices` (under tensor
        parallelism: gathered on rank 0; the other ranks get their own vocabulary slice [S, V/N])."""
        x = self.norm(x[logits_indices])  # [S, H]; norm is per-token, so select first
        logits = self.lm_head(x).float()  # [S, V/N]
        if self.tp is None:
            return logits
        gathered = self.tp.gather_columns(logits)  # [S, V] on rank 0
        return logits if gathered is None else gathered
