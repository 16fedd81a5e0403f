"""A random-initialised EAGLE-1 head for a target model folder, in the layout vLLM loads as
`EagleLlamaForCausalLM` (engine/spec/eagle_head.py): config.json (LlamaForCausalLM, the
target's shapes, one decoder layer), model.safetensors with `fc.weight` [H, 2H] and
`layers.0.*` (no input_layernorm), optionally `embed_tokens.weight` (a copy of the target's).
A random head guesses badly (acceptance near 0): it exists so tests and benchmarks can run
the whole EAGLE path on real shapes. `pdserve make-model --eagle-for TARGET --out DIR`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdserve.engine.weights import safetensors_files
from pdserve.modelgen.make_model import _init_weights

_COPIED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def make_eagle_head(target: str | Path, out: str | Path, seed: int = 0, own_embedding: bool = False) -> Path:
    """Write a head for the Llama-family folder `target` into `out`; returns `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target, out = Path(target), Path(out)
    tcfg = json.loads((target / "config.json").read_text())
    fields = {k: tcfg[k] for k in _COPIED if tcfg.get(k) is not None}
    head_dim = tcfg.get("head_dim") or tcfg["hidden_size"] // tcfg["num_attention_heads"]
    cfg = LlamaConfig(**fields, num_hidden_layers=1, head_dim=head_dim, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    _init_weights(model, seed)
    hidden = cfg.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5}
    for name, t in model.state_dict().items():
        name = name.removeprefix("model.")
        if name.startswith("layers.") and name != "layers.0.input_layernorm.weight":
            tensors[name] = t.contiguous()
    if own_embedding:  # a copy of the target's (EAGLE heads train with it frozen)
        for file in safetensors_files(target):
            with safe_open(str(file), framework="pt") as f:
                if "model.embed_tokens.weight" in f.keys():
                    tensors["embed_tokens.weight"] = f.get_tensor("model.embed_tokens.weight")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)
    if (target / "generation_config.json").is_file():
        shutil.copy(target / "generation_config.json", out / "generation_config.json")
    return out
