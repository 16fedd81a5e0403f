"""HF configs of the families pdserve serves through transformers' own modelling code
(engine/models/transformers_backend.py), for `make_model --arch`: tiny random folders of each.

Each family's config sets what makes it differ from Llama, so a test of it exercises that:
OLMo 2 (q/k RMSNorm over all heads, norms after the sublayers), Granite (embedding, residual,
attention and logit multipliers: attention scaling other than head_dim**-0.5), GPT-NeoX (partial
rotary, parallel residual, LayerNorm with bias, untied embed_in/embed_out), StableLM (partial
rotary, qkv bias, LayerNorm); and the mixtures of experts served natively: Qwen2-MoE (top-k routed
experts plus a gated shared expert), Qwen3-MoE (q/k norm, a dense first layer), Mixtral.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from pdserve.modelgen.make_model import ModelPreset

TRANSFORMERS_ARCHS = ("olmo2", "granite", "gpt_neox", "stablelm")
GEMMA_ARCHS = ("gemma2", "gemma3")  # served natively (engine/models/gemma.py)
MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral")  # served natively (engine/models/moe.py)
# Small enough that test prompts cross it (with 16-token blocks: blocks fall out of the window).
GEMMA_TINY_WINDOW = 32


def shape_fields(p: ModelPreset, vocab: int, eos_id: int) -> dict[str, Any]:
    """The HF config fields every family takes from a preset: sizes, tying, the special ids."""
    return dict(
        vocab_size=vocab,
        hidden_size=p.hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=p.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def gemma_family_config(arch: str, p: ModelPreset, vocab: int, eos_id: int, extra: dict[str, Any]) -> PretrainedConfig:
    """Gemma 2 / Gemma 3 text at preset `p`'s shape, with what sets them apart made to matter:
    layers alternating sliding (window GEMMA_TINY_WINDOW) and full, query_pre_attn_scalar other
    than head_dim, soft-capping tight enough to bite (Gemma 2), a local rope base for sliding
    layers and a global base with linear scaling for full ones (Gemma 3). `extra` overrides."""
    from transformers import Gemma2Config, Gemma3TextConfig

    head_dim = p.head_dim or p.hidden_size // p.num_heads
    fields: dict[str, Any] = dict(
        **shape_fields(p, vocab, eos_id),
        intermediate_size=p.intermediate_size,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=2 * head_dim,
        sliding_window=GEMMA_TINY_WINDOW,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(p.num_layers)],
        hidden_activation="gelu_pytorch_tanh",
    )
    if arch == "gemma2":
        fields.update(attn_logit_softcapping=3.0, final_logit_softcapping=8.0)
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": p.rope_theta}
        fields.update(extra)
        return Gemma2Config(**fields)
    if arch == "gemma3":
        fields["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": p.rope_theta},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100 * p.rope_theta},
        }
        fields.update(extra)
        return Gemma3TextConfig(**fields)
    raise ValueError(f"unknown Gemma arch {arch!r}; choose {', '.join(GEMMA_ARCHS)}")


def moe_family_config(arch: str, p: ModelPreset, vocab: int, eos_id: int, extra: dict[str, Any]) -> PretrainedConfig:
    """Qwen2-MoE / Qwen3-MoE / Mixtral at preset `p`'s shape, 2 experts a token: Qwen2-MoE 4 of
    half the MLP's width beside a shared expert of its full width; Qwen3-MoE 8, its first layer
    dense (`mlp_only_layers`) and its top-k weights renormalised; Mixtral 8. A preset with `experts`
    (a real model's shape) sets their number, top-k and width, every layer sparse. `extra` overrides."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    fields: dict[str, Any] = dict(
        **shape_fields(p, vocab, eos_id),
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        num_experts_per_tok=2,
    )
    real: dict[str, Any] = {}  # a real shape's experts (Mixtral: its MLP width is the experts')
    if p.experts is not None:
        count, per_token, width = p.experts
        if arch == "mixtral":
            real = dict(num_local_experts=count, num_experts_per_tok=per_token, intermediate_size=width)
        else:
            real = dict(num_experts=count, num_experts_per_tok=per_token, moe_intermediate_size=width)
        if arch == "qwen3_moe":
            real["mlp_only_layers"] = []
    if arch == "qwen2_moe":
        fields.update(
            intermediate_size=p.intermediate_size,
            moe_intermediate_size=p.intermediate_size // 2,
            num_experts=4,
            shared_expert_intermediate_size=p.intermediate_size,
            use_sliding_window=False,
            rms_norm_eps=1e-5,
        )
        fields.update({**real, **extra})
        return Qwen2MoeConfig(**fields)
    if arch == "qwen3_moe":
        fields.update(
            head_dim=p.head_dim or 2 * p.hidden_size // p.num_heads,
            intermediate_size=p.intermediate_size,
            moe_intermediate_size=p.intermediate_size // 2,
            num_experts=8,
            norm_topk_prob=True,
            mlp_only_layers=[0] if p.num_layers > 1 else [],
            attention_bias=False,
            use_sliding_window=False,
        )
        fields.update({**real, **extra})
        return Qwen3MoeConfig(**fields)
    if arch == "mixtral":
        fields.update(
            head_dim=p.head_dim or p.hidden_size // p.num_heads,
            intermediate_size=p.intermediate_size // 2,
            num_local_experts=8,
            sliding_window=None,
        )
        fields.update({**real, **extra})
        return MixtralConfig(**fields)
    raise ValueError(f"unknown mixture-of-experts arch {arch!r}; choose {', '.join(MOE_ARCHS)}")


def gemma_rescale_weights(model: torch.nn.Module) -> None:
    """After make_model's generic init: Gemma's norms scale by (1 + weight), so their weights go
    to ~0 (scales ~1), and its embedding is multiplied by sqrt(hidden), so the table shrinks by as
    much; else the (tied) embedding of the last token swamps the residual and greedy output
    repeats it, which would hide a wrong layer."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.sub_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.mul_(param.shape[1] ** -0.5)


def transformers_family_config(
    arch: str, p: ModelPreset, vocab: int, eos_id: int, rope: dict[str, Any]
) -> PretrainedConfig:
    """The HF config of `arch` (one of TRANSFORMERS_ARCHS) at preset `p`'s shape."""
    from transformers import GPTNeoXConfig, GraniteConfig, Olmo2Config, StableLmConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=p.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        rope_parameters=dict(rope),
    )
    gqa: dict[str, Any] = dict(num_key_value_heads=p.num_kv_heads)
    if arch == "olmo2":
        return Olmo2Config(**common, **gqa, rms_norm_eps=1e-5)
    if arch == "granite":
        return GraniteConfig(
            **common,
            **gqa,
            rms_norm_eps=1e-5,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=1.0,  # the attention scale, instead of head_dim**-0.5
            logits_scaling=1.5,
        )
    if arch == "gpt_neox":  # no GQA in GPT-NeoX
        common["rope_parameters"] = {**rope, "partial_rotary_factor": 0.25}
        return GPTNeoXConfig(**common, layer_norm_eps=1e-5, use_parallel_residual=True, hidden_act="gelu")
    if arch == "stablelm":
        common["rope_parameters"] = {**rope, "partial_rotary_factor": 0.25}
        return StableLmConfig(**common, **gqa, layer_norm_eps=1e-5, use_qkv_bias=True)
    raise ValueError(f"unknown transformers-backend arch {arch!r}; choose {', '.join(TRANSFORMERS_ARCHS)}")
