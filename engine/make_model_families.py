"""HF configs of the families pdserve serves through transformers' own modelling code
(engine/models/transformers_backend.py), for `make_model --arch`: tiny random folders of each.

Each family's config sets what makes it differ from Llama, so a test of it exercises that:
OLMo 2 (q/k RMSNorm over all heads, norms after the sublayers), Granite (embedding, residual,
attention and logit multipliers: attention scaling other than head_dim**-0.5), GPT-NeoX (partial
rotary, parallel residual, LayerNorm with bias, untied embed_in/embed_out), StableLM (partial
rotary, qkv bias, LayerNorm), Qwen2-MoE (top-k routed experts plus a gated shared expert).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pdserve.engine.make_model import ModelPreset

TRANSFORMERS_ARCHS = ("olmo2", "granite", "gpt_neox", "stablelm", "qwen2_moe")


def transformers_family_config(
    arch: str, p: ModelPreset, vocab: int, eos_id: int, rope: dict[str, Any]
) -> PretrainedConfig:
    """The HF config of `arch` (one of TRANSFORMERS_ARCHS) at preset `p`'s shape."""
    from transformers import GPTNeoXConfig, GraniteConfig, Olmo2Config, Qwen2MoeConfig, StableLmConfig

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
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **common,
            **gqa,
            rms_norm_eps=1e-5,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=p.intermediate_size // 2,
            shared_expert_intermediate_size=p.intermediate_size,
            use_sliding_window=False,
        )
    raise ValueError(f"unknown transformers-backend arch {arch!r}; choose {', '.join(TRANSFORMERS_ARCHS)}")
