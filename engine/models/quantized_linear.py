"""Weight-only quantized linears (qkv, o, gate_up, down and the LM head), run by
kernels/quant_gemm.py on weights in engine/quantize.py's format. Embeddings and norms stay in
the model's dtype; an embedding table a GGUF file stores in a kept type stays its blocks too
(models/quantized_embedding.py), shared with a tied LM head.

`--quantization int8|int4`: every linear in that scheme; a GGUF linear whose every part (q, k, v;
gate, up) is stored in the scheme's own block type (Q8_0, Q4_0) takes those blocks as they are,
any other is quantized from its loaded float values.
`--quantization auto` (the default) on a GGUF file: every linear whose parts are all stored in a
kept type (engine/quantize.py KEPT_GGUF_TYPES) keeps them, each part in its own format (a fused
linear of mixed types, e.g. Q4_K q/k with a Q6_K v, runs one kernel call per format); the rest
stay float. With int8 activations (one rank), a part stored as Q4_K, Q5_K, Q6_K or Q8_0 is the
file's blocks themselves (kernels/block_gemm.py, mapped, never copied). Decode steps of up to 48
(int4) / 64 (int8) rows run every layer in one call (kernels/decode_layers.py), the quantized GEMM
called for each linear. With `--prompt-linears bf16` the layers' linears on those blocks multiply a
step's prompt rows in bf16 (`use_bf16_prompts`; the model runner names the step's prompt rows,
`prompt_rows_from`), its decode rows as before.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from pdserve.engine.config import QUANTIZATIONS
from pdserve.engine.models.quantized_embedding import QuantizedEmbedding
from pdserve.engine.quantize import GGUF_TYPES, KEPT_GGUF_TYPES, concat_rows, from_gguf_blocks, quantize, same_format
from pdserve.kernels import block_gemm, quant_gemm
from pdserve.kernels.block_gemm import BlockWeight
from pdserve.kernels.quant_gemm import QuantWeight

if TYPE_CHECKING:
    from pdserve.engine.gguf_weights import GgufTensor
    from pdserve.engine.models.llama import LlamaForCausalLM

Part = QuantWeight | BlockWeight  # a row segment in one format
_step = threading.local()  # .rows: (first prompt row, rows) of the step this thread runs layers of


@contextmanager
def prompt_rows_from(first: int, rows: int) -> Iterator[None]:
    """Within: this thread runs a step's layers on `rows` rows, those from `first` on prompts' (the
    decodes' rows come first)."""
    before = getattr(_step, "rows", None)
    _step.rows = (first, rows)
    try:
        yield
    finally:
        _step.rows = before


def _first_prompt_row(m: int) -> int | None:
    """The first prompt row of an `m`-row call within a step of m rows; None: not a step's rows."""
    rows = getattr(_step, "rows", None)
    return rows[0] if rows is not None and rows[1] == m else None


class QuantizedLinear(nn.Module):
    """y = x dequant(W)^T (+ b) with W kept quantized (group-wise, or a GGUF file's blocks as stored),
    as one or more row segments (`parts`, one format each). x in the model's dtype (fp32 or bf16: the kernel computes in fp32
    and the result is cast back)."""

    def __init__(self, parts: Part | list[Part], bias: torch.Tensor | None) -> None:
        super().__init__()
        parts = [parts] if isinstance(parts, (QuantWeight, BlockWeight)) else parts
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self._formats: list[tuple] = []
        for i, p in enumerate(parts):  # parameters, so .to() / state_dict see them
            if isinstance(p, BlockWeight):  # a file's blocks as stored (no copy)
                self._formats.append(("blocks", p.qtype, p.in_features))
                self.register_parameter(f"q{i}", nn.Parameter(p.blocks, requires_grad=False))
                continue
            self._formats.append((p.bits, p.in_features, p.scale_group))
            self.register_parameter(f"q{i}", nn.Parameter(p.q, requires_grad=False))
            self.register_parameter(f"scales{i}", nn.Parameter(p.scales, requires_grad=False))
            off = None if p.offsets is None else nn.Parameter(p.offsets, requires_grad=False)
            self.register_parameter(f"offsets{i}", off)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self.int8_activations = False  # few-row calls quantize x per group of 32 (`use_int8_activations`)
        self.bf16_prompts = False  # a step's prompt rows on the blocks in bf16 (`use_bf16_prompts`)

    @property
    def parts(self) -> list[Part]:
        out: list[Part] = []
        for i, fmt in enumerate(self._formats):
            q = getattr(self, f"q{i}").data
            if fmt[0] == "blocks":
                out.append(BlockWeight(fmt[1], q, fmt[2]))
                continue
            bits, n_in, sg = fmt
            off = getattr(self, f"offsets{i}")
            out.append(
                QuantWeight(bits, q, getattr(self, f"scales{i}").data, n_in, None if off is None else off.data, sg)
            )
        return out

    @property
    def weight(self) -> Part:
        """The one format's weight (a linear of several formats has `parts`)."""
        (only,) = self.parts
        return only

    def _part(self, x: torch.Tensor, p: Part, bias: torch.Tensor | None, y: torch.Tensor, first: int | None) -> None:
        """y [T, p's outputs] (a view of the output's columns) = x's product with one part; rows
        from `first` on (None: none) are prompts' to multiply in bf16."""
        if first is None or not isinstance(p, BlockWeight):
            y.copy_(self._one(x, p, bias))
            return
        if first > 0:  # the decodes' rows
            y[:first] = block_gemm.linear(x[:first], p, bias)
        block_gemm.linear_bf16(x[first:], p, bias, out=y[first:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts, xf = self.parts, x.float()
        first = _first_prompt_row(x.shape[0]) if self.bf16_prompts else None
        if first is not None and first >= x.shape[0]:
            first = None  # no prompt rows in this step
        if len(parts) == 1 and first is None:
            return self._one(xf, parts[0], self.bias).to(x.dtype)  # [T, out] fp32, no copy
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        at = 0
        for p in parts:  # each part's columns written in place
            self._part(xf, p, self.bias if len(parts) == 1 else None, y[:, at : at + p.out_features], first)
            at += p.out_features
        if len(parts) > 1 and self.bias is not None:
            y += self.bias
        return y.to(x.dtype)

    def _one(self, x: torch.Tensor, p: Part, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(p, BlockWeight):
            return block_gemm.linear(x, p, bias)  # x quantized per 256 (any number of rows)
        return quant_gemm.linear(x, p, bias, self.int8_activations)


def few_rows(p: Part) -> int:
    """Rows up to which a part's few-row kernel runs (the decode driver's limit): the block
    kernel runs for any number."""
    return 1 << 30 if isinstance(p, BlockWeight) else quant_gemm.FEW_ROWS[p.bits]


def _linear_owners(model: LlamaForCausalLM) -> dict[str, nn.Module]:
    """Our linear's name (e.g. layers.0.self_attn.qkv_proj) -> the module holding it."""
    from pdserve.engine.models.moe import SparseMoeBlock  # (which runs QuantizedLinear's experts)

    owners: dict[str, nn.Module] = {"lm_head": model}
    for layer in model.decoder_layers:
        i = layer.self_attn.layer
        owners.update({f"layers.{i}.self_attn.{n}": layer.self_attn for n in ("qkv_proj", "o_proj")})
        mlps: dict[str, nn.Module] = {f"layers.{i}.mlp": layer.mlp}
        if isinstance(layer.mlp, SparseMoeBlock):  # each expert's (the router stays float)
            mlps = {f"layers.{i}.mlp.experts.{e}": expert for e, expert in layer.mlp.experts.items()}
            if layer.mlp.shared_expert is not None:
                mlps[f"layers.{i}.mlp.shared_expert"] = layer.mlp.shared_expert
        for prefix, mlp in mlps.items():
            owners.update({f"{prefix}.{n}": mlp for n in ("gate_up_proj", "down_proj")})
    return owners


def keep_gguf_blocks(model: LlamaForCausalLM, scheme: str, path: str | Path, as_stored: bool = False) -> None:
    """Before the model gets storage: every linear a GGUF file stores whole in a kept type
    (`scheme` auto: any of KEPT_GGUF_TYPES; int8 / int4: Q8_0 / Q4_0) becomes a QuantizedLinear
    of those blocks, read straight from the file: its weight is never dequantized, so loading
    needs no more memory than the quantized model (engine/weights.py skips these).
    `as_stored` (int8 activations, one rank): the blocks kernels/block_gemm.py reads stay the
    file's own bytes, mapped, not copied (workers mapping one file share its pages); the rest are
    copied into the group-wise format."""
    if scheme not in QUANTIZATIONS or scheme == "none":
        raise ValueError(f"unknown quantization {scheme!r}; choose {', '.join(QUANTIZATIONS)}")
    as_stored = as_stored and model.tp is None and block_gemm.available()
    stored = _gguf_blocks(model, path, scheme, as_stored)
    for name, owner in _linear_owners(model).items():
        parts = stored.get(f"{name}.weight")
        if parts is None:
            continue
        attr = name.rpartition(".")[2]
        linear = getattr(owner, attr)
        got = (sum(p.out_features for p in parts), parts[0].in_features)
        if got != tuple(linear.weight.shape):
            raise ValueError(
                f"{name}: stored blocks make {got[0]}x{got[1]}, the model wants {tuple(linear.weight.shape)}"
            )
        setattr(owner, attr, QuantizedLinear(parts, linear.bias))  # (its bias, on meta, is loaded later)
    table = stored.get("embed_tokens.weight") or (
        stored.get("lm_head.weight") if model.cfg.tie_word_embeddings else None
    )
    if table is not None and len(table) == 1 and model.tp is None:  # (vocab-parallel ranks keep a float slice)
        model.embed_tokens = QuantizedEmbedding(table[0])  # a tied head's blocks shared, no float table


def use_int8_activations(model: nn.Module) -> int:
    """`--activation-quantization int8`: every QuantizedLinear's few-row calls (decode steps,
    short prompts) quantize their input rows to int8 per group of 32 and multiply in integers
    (kernels/cpu_quant_dot.c, as llama.cpp does); many-row calls keep fp32 activations. Returns
    how many linears it set."""
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for m in linears:
        m.int8_activations = True
    return len(linears)


def use_bf16_prompts(model: LlamaForCausalLM) -> int:
    """`--prompt-linears bf16`: the decoder layers' linears on a file's blocks (not the LM head, whose
    prompt rows are a few sampled ones, nor routed experts, which see gathered rows) multiply a
    step's prompt rows in bf16. Returns how many linears it set."""
    count = 0
    for name, owner in _linear_owners(model).items():
        if name == "lm_head" or ".experts." in name:
            continue
        m = getattr(owner, name.rsplit(".", 1)[1])
        if isinstance(m, QuantizedLinear) and any(isinstance(p, BlockWeight) for p in m.parts):
            m.bf16_prompts = True
            count += 1
    return count


def quantize_model(model: LlamaForCausalLM, scheme: str) -> None:
    """`--quantization int8|int4` after loading: every linear still float (nn.Linear) becomes a
    QuantizedLinear of its weights quantized to `scheme` (those kept from a GGUF file's blocks
    already are; with `auto` the rest stay float)."""
    if scheme not in ("int8", "int4"):
        raise ValueError(f"quantize_model takes int8 or int4, not {scheme!r}")
    with torch.no_grad():
        for name, owner in _linear_owners(model).items():
            attr = name.rpartition(".")[2]
            linear = getattr(owner, attr)
            if isinstance(linear, nn.Linear):  # (before the CPU relayout, which skips QuantizedLinear)
                setattr(owner, attr, QuantizedLinear(quantize(linear.weight, scheme), linear.bias))


def _gguf_blocks(model: LlamaForCausalLM, path: str | Path, scheme: str, as_stored: bool) -> dict[str, list[Part]]:
    """Our parameter name -> its weight from the file's blocks as row segments, for the linears
    stored whole in kept types: the scheme's own (int8: Q8_0, int4: Q4_0), or with `auto` any of
    KEPT_GGUF_TYPES. Fused ones from their parts, in row order: `as_stored`, each tensor the
    block kernel reads is a segment of its own, its bytes the file's; the others are copied into
    the group-wise format (neighbours of one format stacked into one segment)."""
    from pdserve.engine.gguf_weights import gguf_tensors
    from pdserve.engine.weights import fused_slices

    kept = KEPT_GGUF_TYPES if scheme == "auto" else (GGUF_TYPES[scheme],)
    fused = fused_slices(model)
    parts: dict[str, list[tuple[int, GgufTensor]]] = {}
    for hf_name, tensor in gguf_tensors(path, model.cfg):
        name = hf_name.removeprefix("model.")
        if name == "embed_tokens.weight" and model.cfg.tie_word_embeddings:
            name = "lm_head.weight"  # the tied head reads the embedding's blocks
        target, start = fused[name][:2] if name in fused else (name, 0)
        if target.endswith("proj.weight") or target in ("lm_head.weight", "embed_tokens.weight"):
            parts.setdefault(target, []).append((start, tensor))
    out: dict[str, list[Part]] = {}
    for target, found in parts.items():
        if not all(t.qtype in kept for _, t in found):
            continue
        segments: list[list[Part]] = []
        for _, t in sorted(found, key=lambda p: p[0]):
            if as_stored and block_gemm.readable(int(t.qtype), t.shape[1]):
                segments.append([BlockWeight(int(t.qtype), _mapped(t.hf_rows()), t.shape[1])])
                continue
            w = from_gguf_blocks(t.hf_rows(), t.qtype, t.shape[1])
            if segments and isinstance(segments[-1][-1], QuantWeight) and same_format(segments[-1][-1], w):
                segments[-1].append(w)  # neighbours of one format stack into one segment
            else:
                segments.append([w])
        out[target] = [s[0] if isinstance(s[0], BlockWeight) else concat_rows(s) for s in segments]  # type: ignore[arg-type]
    return out


def _mapped(rows: np.ndarray) -> torch.Tensor:
    """A view of the file's (read-only) map as a uint8 tensor: never written (the kernels only read)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(rows)
