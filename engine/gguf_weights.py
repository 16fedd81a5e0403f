"""A GGUF file's tensors under their HF names, in HF's layout, for engine/weights.py.

Each comes as a `GgufTensor`: its raw stored data (float values, or quantized blocks: whole
blocks per row) with llama.cpp's q/k row permutation undone on the rows, and `dequantize()` for
the float tensor (exact: GGUF dequantization is arithmetic on the stored values). Today the
loader dequantizes every tensor; weight-only quantized linears can take `hf_rows()` instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import gguf
import numpy as np
import torch

from pdserve.engine.gguf_file import metadata, open_gguf

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {  # llama.cpp's per-layer name -> HF's, below model.layers.{i}.
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: fused, rows q | k | v
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# a mixture's experts, stacked [E, out, in] in one tensor: one HF name per expert
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_PHI3_FUSED_UP = "mlp.gate_up_proj"  # phi3's ffn_up holds gate | up
_GEMMA_LAYER = {  # Gemma's norms around both sublayers (llama.cpp's ffn_norm is the pre-MLP one)
    **_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GgufWeightError(ValueError):
    pass


@dataclass(frozen=True)
class GgufTensor:
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # the float tensor's, outermost first
    raw: np.ndarray  # as stored (memory-mapped): [*shape] floats, or [rows, bytes] quantized blocks
    permute_heads: int | None = None  # llama q/k: llama.cpp interleaved each head's rotate-half pairs

    def hf_rows(self) -> np.ndarray:
        """The raw data with rows in HF's order (rows are whole blocks, so this holds for any type)."""
        if self.permute_heads is None:
            return self.raw
        w, n = self.raw, self.permute_heads
        # [n * d, ...] -> [n, d/2, 2, ...]: llama.cpp's pairs back to halves -> [n, 2, d/2, ...]
        return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def dequantize(self) -> torch.Tensor:
        """[*shape] float32."""
        try:
            values = gguf.quants.dequantize(self.hf_rows(), self.qtype)
        except NotImplementedError:
            raise GgufWeightError(f"GGUF type {self.qtype.name} cannot be dequantized by the gguf package") from None
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape)  # a copy: the map is read-only


def hf_name(gguf_name: str, arch: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    m = _LAYER_NAME.fullmatch(gguf_name)
    names = _GEMMA_LAYER if arch in ("gemma2", "gemma3") else _LAYER
    if m is None or m.group(2) not in names:
        return None
    inner = _PHI3_FUSED_UP if arch == "phi3" and m.group(2) == "ffn_up" else names[m.group(2)]
    return f"model.layers.{m.group(1)}.{inner}.{m.group(3)}"


def gguf_tensors(path: str | Path, cfg: "ModelConfig") -> Iterator[tuple[str, GgufTensor]]:
    """(HF name, tensor) for every tensor in the file (a stacked experts' tensor: one per expert,
    a view of its rows); an unknown name raises."""
    reader = open_gguf(str(path))
    arch = metadata(reader, "general.architecture")
    for t in reader.tensors:
        m = _LAYER_NAME.fullmatch(t.name)
        if m is not None and m.group(2) in _EXPERTS:
            qtype, shape = gguf.GGMLQuantizationType(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist()))
            for e in range(shape[0]):  # data [E, out, in] floats or [E, out, bytes] blocks
                expert = f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERTS[m.group(2)]}.weight"
                yield expert, GgufTensor(qtype, shape[1:], t.data[e])
            continue
        name = hf_name(t.name, arch)
        if name is None:
            raise GgufWeightError(f"{path}: tensor {t.name} has no place in the model")
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        heads = None
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = cfg.num_heads
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = cfg.num_kv_heads
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = t.data
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:  # llama.cpp's {hidden}: HF's [1, hidden]
            shape, data = (1, shape[0]), data.reshape(1, -1)
        yield name, GgufTensor(qtype, shape, data, heads)
