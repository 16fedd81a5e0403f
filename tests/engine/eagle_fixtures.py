"""EAGLE heads for tests, and an independent reference of what a head proposes (HF transformers'
Llama modules, no paging, no KV cache: every step recomputed from scratch)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.modelgen.make_eagle_head import make_eagle_head
from tests.conftest import _hf_model


def echo_head(target: Path, out: Path, scale: float) -> Path:
    """A head that mostly passes the target's hidden state through (fc = [0 | I]; its layer's
    o_proj and down_proj scaled by `scale`): it guesses "the last token again", which the tiny
    models' looping greedy output often confirms. `scale` > 0 keeps its attention (its KV) in
    play: 0.5 gives drafts accepted and rejected at every position."""
    if out.exists():
        return out
    make_eagle_head(target, out)
    file = out / "model.safetensors"
    tensors = load_file(file)
    hidden = tensors["fc.weight"].shape[0]
    tensors["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)  # [H, 2H]
    for name in list(tensors):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * scale
    save_file(tensors, str(file), metadata={"format": "pt"})
    return out


@functools.lru_cache(maxsize=None)
def _reference_head(head: str) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """HF's LlamaModel with the head's layer(s), layer 0's input norm and the final norm
    removed (EAGLE-1: the output is the residual stream), and the head's fc."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig.from_pretrained(head)
    model = LlamaModel(cfg).eval()
    tensors = load_file(str(Path(head) / "model.safetensors"))
    model.layers[0].input_layernorm = torch.nn.Identity()
    model.norm = torch.nn.Identity()
    layer_weights = {k: v for k, v in tensors.items() if k.startswith("layers.")}
    missing, unexpected = model.load_state_dict(layer_weights, strict=False)
    assert not unexpected and all(not k.startswith("layers.") for k in missing), (missing, unexpected)
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    fc.weight.data.copy_(tensors["fc.weight"])
    return model, fc


@torch.no_grad()
def reference_proposal(target: Path, head: Path, tokens: list[int], base: int, k: int) -> list[int]:
    """The k greedy drafts an EAGLE head proposes after the real `tokens` when its context
    starts at position `base`: the target's (post-norm) hidden states h_p for p < n - 1 paired
    with t_{p+1}, then its own outputs paired with its own drafts."""
    model, fc = _reference_head(str(head))
    hf = _hf_model(str(target))
    n = len(tokens)
    h = hf.model(torch.tensor([tokens[: n - 1]])).last_hidden_state[0]  # [n-1, H]
    embed = hf.model.embed_tokens
    feed_tokens, feed_hidden = list(tokens[base + 1 : n]), list(h[base : n - 1])
    drafts: list[int] = []
    for _ in range(k):
        x = fc(torch.cat([embed(torch.tensor(feed_tokens)), torch.stack(feed_hidden)], dim=-1))  # [t, H]
        positions = torch.arange(base, base + len(feed_tokens))[None]
        out = model(inputs_embeds=x[None], position_ids=positions).last_hidden_state[0, -1]  # [H]
        drafts.append(int(hf.lm_head(out).argmax()))
        feed_tokens.append(drafts[-1])
        feed_hidden.append(out)
    return drafts
