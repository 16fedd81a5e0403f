"""Weights under our per-tensor HF names (as checkpoints and engine/gguf_weights.py name them) written
into a transformers model's state dict, where transformers 5 holds a mixture's experts stacked:
`mlp.experts.e.{gate,up}_proj.weight` -> rows of `mlp.experts.gate_up_proj` [E, 2I, H] (gate | up),
`mlp.experts.e.down_proj.weight` -> `mlp.experts.down_proj` [E, H, I]. For references built from a
GGUF file's values (tests, bench/gguf_agreement.py)."""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def copy_into_hf_state(state: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    """state[name] = value, an expert's weight into its rows of the stacked tensors."""
    m = _EXPERT.fullmatch(name)
    if m is None or name in state:
        state[name].copy_(value)
        return
    stacked, e, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down":
        state[f"{stacked}.down_proj"][e].copy_(value)
        return
    inter = value.shape[0]
    rows = slice(0, inter) if kind == "gate" else slice(inter, 2 * inter)
    state[f"{stacked}.gate_up_proj"][e][rows].copy_(value)
