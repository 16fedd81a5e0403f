"""An EAGLE-1 speculation head for a Llama-family target, in the checkpoint layout vLLM loads
(`EagleLlamaForCausalLM`): a folder with a LlamaForCausalLM-style config.json (usually one
decoder layer) and safetensors holding

    fc.weight               [H, 2H]   input: concat(embedding of the next token, target hidden)
    layers.i.*              decoder layer(s) as in HF Llama; layer 0 has no input_layernorm
    embed_tokens.weight     optional; absent: the target's embedding is shared
    lm_head.weight          optional and ignored: the target's LM head is used (as vLLM does)

The head maps (token embedding [T, H], target hidden state [T, H]) at a position to a hidden
state [T, H] (the last layer's output plus its residual, no final norm) whose logits under the
target's LM head guess the token after the next one. It runs over a paged KV pool of its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.llama import DecoderLayer, ForwardContext, LlamaForCausalLM
from pdserve.engine.models.rotary import RotaryEmbedding
from pdserve.engine.parallel.shard import TensorParallelShard
from pdserve.engine.weights import Piece, WeightLoadError, safetensors_files, weight_pieces

log = logging.getLogger(__name__)

# Stored by some EAGLE checkpoints, not used by the head (vLLM skips them too).
_UNUSED = ("lm_head.weight", "layers.0.input_layernorm.weight")


def check_head_fits(target: ModelConfig, head: ModelConfig) -> None:
    """The head must read the target's hidden states and speak its tokens."""
    if head.hidden_size != target.hidden_size or head.vocab_size != target.vocab_size:
        raise ValueError(
            f"EAGLE head {head.path} has hidden size {head.hidden_size} and {head.vocab_size} tokens; the target "
            f"{target.hidden_size} and {target.vocab_size}: the head was trained for another model"
        )


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, own_embedding: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = TensorParallelShard()  # (weights.weight_pieces reads it: the whole model)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        cast(DecoderLayer, self.layers[0]).input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dims, max_positions)

    def forward(
        self,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """embedded/hidden [T, H], positions [T] -> the head's hidden states [T, H]."""
        x = self.fc(torch.cat([embedded, hidden], dim=-1))  # [T, 2H] -> [T, H]
        rope = self.rotary.tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, ctx)  # [T, H] (the residual stream: layer output + residual)
        return x


def load_eagle_head(
    folder: str | Path, target: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, max_positions: int
) -> EagleHead:
    """The head in `folder` for `target` (fails loudly on missing, unknown or mis-shaped tensors)."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder, "native")
    check_head_fits(target.cfg, cfg)
    files = safetensors_files(folder)
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    with torch.device("meta"):
        head = EagleHead(cfg, max_positions, own_embedding="embed_tokens.weight" in names)
    head.to_empty(device=device)
    head.to(dtype)
    head.rotary.build_tables(device)
    params = dict(head.named_parameters())
    pieces = weight_pieces(head)  # type: ignore[arg-type]  # (reads cfg and shard only)
    covered = {n: 0 for n in params}
    unexpected: list[str] = []
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in _UNUSED:
                        log.info(
                            "EAGLE head %s: %s not used (the target's LM head; layer 0 has no input norm)", folder, name
                        )
                        continue
                    todo = pieces.get(name) or ([Piece(name, 0, params[name].shape[0])] if name in params else [])
                    if not todo or any(p.target not in params for p in todo):
                        unexpected.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    for p in todo:
                        dest, src = params[p.target][p.start : p.end], tensor[p.source] if p.source else tensor
                        if src.shape != dest.shape:
                            raise WeightLoadError(
                                f"{name}: shape {tuple(src.shape)} != {tuple(dest.shape)} in {folder}"
                            )
                        dest.copy_(src.to(dest.dtype))
                        covered[p.target] += p.end - p.start
    if unexpected:
        raise WeightLoadError(f"EAGLE head {folder}: unexpected tensors {unexpected[:8]}")
    missing = [n for n, rows in covered.items() if rows != params[n].shape[0]]
    if missing:
        raise WeightLoadError(f"EAGLE head {folder}: missing weights {missing[:8]}")
    return head.eval()
