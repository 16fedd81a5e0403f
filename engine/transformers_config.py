"""ModelConfig for a model served through transformers' modelling code, derived from any HF
decoder-only config.json (torch-free: the gateway reads it too). What the engine needs of it:
the KV pool's shape (layers, KV heads, head dim), the vocabulary, EOS ids, the longest sequence
served exactly, and the fingerprint parts. Refused, naming why: encoder-decoder, multimodal and
non-causal models, what the paged kernels cannot do exactly (attention logit soft-capping,
alibi, dynamic NTK rope, whose frequencies depend on the batch's longest sequence), and layers of
mixed attention types (models/transformers_backend.py gives every layer layer 0's inputs).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "speech_config", "image_token_index", "image_token_id")


def _first(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` set in cfg (families name the same thing differently)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def refusal(cfg: dict[str, Any]) -> str | None:
    """Why this config cannot be served through transformers, or None."""
    archs = cfg.get("architectures") or []
    if cfg.get("is_encoder_decoder"):
        return f"{archs or cfg.get('model_type')} is an encoder-decoder model; pdserve serves decoder-only models"
    if any(key in cfg for key in _MULTIMODAL_KEYS):
        return f"{archs or cfg.get('model_type')} is multimodal; pdserve serves text-only decoder models"
    if archs and not any(a.endswith(_CAUSAL_SUFFIXES) for a in archs):
        return f"{archs} is not a causal language model (no *ForCausalLM architecture)"
    if cfg.get("is_decoder") is False and cfg.get("model_type") in ("bert", "roberta"):
        return f"{cfg.get('model_type')} is not causal"
    if cfg.get("attn_logit_softcapping"):
        return "attention logit soft-capping, which the paged attention kernels do not do"
    if cfg.get("alibi") or (cfg.get("attn_config") or {}).get("alibi") or cfg.get("model_type") == "bloom":
        return "alibi attention biases, which the paged attention kernels do not add"
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        return "dynamic NTK rope scaling: its frequencies depend on the batch's longest sequence"
    if len(set(cfg.get("layer_types") or [])) > 1:  # e.g. Gemma 3: local and global rope per type
        return (
            f"layers of different attention types ({', '.join(sorted(set(cfg['layer_types'])))}) may get different "
            "inputs from their model; the transformers backend gives every layer what layer 0 gets"
        )
    return None


def transformers_model_config(path: Path, cfg: dict[str, Any]) -> ModelConfig:
    """`cfg` (config.json of the folder `path`) as a ModelConfig with impl `transformers`."""
    from pdserve.engine.config import ModelConfig, RopeConfig, eos_token_ids

    why = refusal(cfg)
    if why is not None:
        raise ValueError(f"{path}: {why}")
    archs = cfg.get("architectures") or []
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    num_heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    num_layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    if hidden is None or num_heads is None or num_layers is None:
        raise ValueError(f"{path}/config.json: cannot tell its hidden size, heads or layers")
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    max_positions = int(_first(cfg, "max_position_embeddings", "n_positions", "max_sequence_length", default=2048))
    if (
        rope.get("rope_type", rope.get("type")) == "longrope"
    ):  # past it HF switches to long_factor for the whole sequence
        max_positions = min(max_positions, int(_first(rope, "original_max_position_embeddings", default=max_positions)))
    uses_window = cfg.get("use_sliding_window", True) and (
        not cfg.get("layer_types") or "sliding_attention" in cfg["layer_types"]
    )
    return ModelConfig(
        path=str(path),
        architecture=next((a for a in archs if a.endswith(_CAUSAL_SUFFIXES)), str(cfg.get("model_type"))),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(hidden),
        intermediate_size=int(_first(cfg, "intermediate_size", "ffn_hidden_size", "n_inner", default=4 * hidden)),
        num_layers=int(num_layers),
        num_heads=int(num_heads),
        num_kv_heads=int(_first(cfg, "num_key_value_heads", "num_kv_heads", default=num_heads)),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(_first(cfg, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-5)),
        rope=RopeConfig(),  # transformers' own rotary code runs; this one is unused
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=False,
        eos_token_ids=eos_token_ids(path, cfg),
        sliding_window=cfg.get("sliding_window") if uses_window else None,  # caps max_context: never cut
        impl="transformers",
    )
