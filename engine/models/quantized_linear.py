"""`--quantization int8|int4`: the model's linears (qkv, o, gate_up, down and the LM head) as
weight-only group-wise int8 / int4 (engine/quantize.py), run by kernels/quant_gemm.py.
Embeddings and norms stay in the model's dtype. A tied LM head gets its own quantized copy (the
embedding lookup keeps the float table).

From a GGUF file, a linear whose every part (q, k, v; gate, up) is stored in the scheme's own
block type (Q8_0 for int8, Q4_0 for int4) takes those blocks as they are; any other is quantized
from its loaded float values. Quantized models run their layers one op at a time: the one-call
decode driver (kernels/decode_layers.py) takes only fp32 panels.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.config import QUANTIZATIONS
from pdserve.engine.gguf_file import is_gguf
from pdserve.engine.quantize import GGUF_TYPES, concat_rows, from_gguf_blocks, quantize
from pdserve.kernels import quant_gemm
from pdserve.kernels.quant_gemm import QuantWeight

if TYPE_CHECKING:
    from pdserve.engine.gguf_weights import GgufTensor
    from pdserve.engine.models.llama import LlamaForCausalLM


class QuantizedLinear(nn.Module):
    """y = x dequant(W)^T (+ b) with W kept group-wise quantized. x in the model's dtype (fp32
    or bf16: the kernel computes in fp32 and the result is cast back)."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits = weight.bits
        self.q = nn.Parameter(weight.q, requires_grad=False)  # int8 [out, G * 32] / uint8 [out, G * 16]
        self.scales = nn.Parameter(weight.scales, requires_grad=False)  # fp32 [out, G]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    @property
    def weight(self) -> QuantWeight:
        return QuantWeight(self.bits, self.q.data, self.scales.data, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_gemm.linear(x.float(), self.weight, self.bias)  # [T, out] fp32
        return y.to(x.dtype)


def quantize_model(model: LlamaForCausalLM, scheme: str, path: str | Path) -> None:
    """Replace the model's linears (loaded, still nn.Linear) by `scheme` QuantizedLinears;
    `path` the weights' source (a GGUF file's matching blocks are taken as stored)."""
    if scheme not in QUANTIZATIONS[1:]:
        raise ValueError(f"unknown quantization {scheme!r}; choose {', '.join(QUANTIZATIONS)}")
    stored = _gguf_blocks(model, path, scheme) if is_gguf(Path(path)) else {}
    owners: dict[str, nn.Module] = {"lm_head": model}
    for layer in model.decoder_layers:
        owners.update(
            {f"layers.{layer.self_attn.layer}.self_attn.{n}": layer.self_attn for n in ("qkv_proj", "o_proj")}
        )
        owners.update({f"layers.{layer.self_attn.layer}.mlp.{n}": layer.mlp for n in ("gate_up_proj", "down_proj")})
    with torch.no_grad():
        for name, owner in owners.items():
            attr = name.rpartition(".")[2]
            linear = getattr(owner, attr)
            assert isinstance(linear, nn.Linear), f"{name} is {type(linear).__name__}: quantize before the CPU relayout"
            weight = stored.get(f"{name}.weight") or quantize(linear.weight, scheme)
            if (weight.out_features, weight.in_features) != tuple(linear.weight.shape):
                raise ValueError(f"{name}: stored blocks make {weight.out_features}x{weight.in_features}")
            setattr(owner, attr, QuantizedLinear(weight, linear.bias))


def _gguf_blocks(model: LlamaForCausalLM, path: str | Path, scheme: str) -> dict[str, QuantWeight]:
    """Our parameter name -> its weight from the file's blocks, for the linears stored whole in
    the scheme's GGUF type (fused ones from their parts, in row order)."""
    from pdserve.engine.gguf_weights import gguf_tensors
    from pdserve.engine.weights import fused_slices

    want = GGUF_TYPES[scheme]
    fused = fused_slices(model)
    parts: dict[str, list[tuple[int, GgufTensor]]] = {}
    for hf_name, tensor in gguf_tensors(path, model.cfg):
        name = hf_name.removeprefix("model.")
        if name == "embed_tokens.weight" and model.cfg.tie_word_embeddings:
            name = "lm_head.weight"  # the tied head reads the embedding's blocks
        target, start = fused[name][:2] if name in fused else (name, 0)
        if target.endswith("proj.weight") or target == "lm_head.weight":
            parts.setdefault(target, []).append((start, tensor))
    out: dict[str, QuantWeight] = {}
    for target, found in parts.items():
        if all(t.qtype == want for _, t in found):
            rows = [from_gguf_blocks(t.hf_rows(), t.qtype, t.shape[1]) for _, t in sorted(found, key=lambda p: p[0])]
            out[target] = concat_rows(rows)
    return out
