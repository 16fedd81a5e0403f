"""Load HF safetensors (single file or sharded), or a GGUF file (engine/gguf_weights.py: same
HF names), into the fused model, failing loudly.

HF name                                   -> our parameter (shard of a fused weight)
model.layers.i.self_attn.{q,k,v}_proj.*   -> layers.i.self_attn.qkv_proj.*   (rows q | k | v)
model.layers.i.mlp.{gate,up}_proj.weight  -> layers.i.mlp.gate_up_proj.weight (rows gate | up)
model.layers.i.self_attn.qkv_proj.weight,  -> the same names: Phi-3 stores them fused, in our row
model.layers.i.mlp.gate_up_proj.weight        order (q | k | v, gate | up), so they load whole
model.* / lm_head.weight                  -> same name without the `model.` prefix
A mixture of experts' layer (models/moe.py), below model.layers.i.:
mlp.experts.e.{gate,up}_proj.weight,       -> mlp.experts.e.gate_up_proj.weight (rows gate | up),
  Mixtral's block_sparse_moe.experts.e.w1 / w3   mlp.experts.e.down_proj.weight (w2); an expert
mlp.experts.gate_up_proj / down_proj       -> stacked [E, ...] as transformers 5 holds them: one per expert
mlp.shared_expert.*, mlp.shared_expert_gate -> Qwen2-MoE's shared expert (fused as a dense MLP)
mlp.gate.weight (block_sparse_moe.gate)   -> the router
Every parameter must be covered exactly; unknown, missing or mis-shaped tensors raise (a rank's
tensor-parallel share leaves out the experts other ranks hold).

Under tensor parallelism a rank reads only its slices (`weight_pieces`, engine/parallel/shard.py):
rows of q/k/v, gate/up, embedding and LM head, columns of o_proj and down_proj (safetensors'
`get_slice` reads just those bytes; a GGUF tensor is dequantized whole, then sliced).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, cast

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.engine.gguf_file import is_gguf
from pdserve.engine.models.mlp import MLP
from pdserve.engine.models.quantized_embedding import QuantizedEmbedding
from pdserve.engine.models.quantized_linear import QuantizedLinear

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models.llama import LlamaForCausalLM
    from pdserve.engine.parallel.shard import TensorParallelShard

log = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    pass


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(
            f"no *.safetensors in {folder} (.bin/pickle checkpoints are not loaded: they can carry code)"
        )
    return files


def fused_slices(model: LlamaForCausalLM) -> dict[str, tuple[str, int, int]]:
    """HF name (without `model.`) -> (our param, row start, row end)."""
    out: dict[str, tuple[str, int, int]] = {}
    cfg = model.cfg
    for i, layer in enumerate(model.decoder_layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.q_size, attn.kv_size
        rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        for name, (a, b) in rows.items():
            for kind in ("weight", "bias"):
                out[f"layers.{i}.self_attn.{name}.{kind}"] = (f"layers.{i}.self_attn.qkv_proj.{kind}", a, b)
        if not cfg.moe_layer(i):
            out.update(_gated_rows(f"layers.{i}.mlp", cast(MLP, mlp).intermediate))
            continue
        for e in range(cfg.num_experts):  # (an expert another rank holds names nothing here)
            out.update(_gated_rows(f"layers.{i}.mlp.experts.{e}", cfg.expert_intermediate_size))
        if cfg.shared_expert_intermediate_size:
            out.update(_gated_rows(f"layers.{i}.mlp.shared_expert", cfg.shared_expert_intermediate_size))
    return out


def _gated_rows(mlp: str, inter: int) -> dict[str, tuple[str, int, int]]:
    """A gated MLP's (models/mlp.py) gate and up weights -> their rows of its fused gate_up."""
    return {
        f"{mlp}.gate_proj.weight": (f"{mlp}.gate_up_proj.weight", 0, inter),
        f"{mlp}.up_proj.weight": (f"{mlp}.gate_up_proj.weight", inter, 2 * inter),
    }


Index = tuple[slice | int, ...]  # into a stored tensor; (): all of it (an int: one expert of a stack)
# (HF name, a reader of (a slice of) it as a tensor): one per stored tensor, from whichever format
TensorSource = Iterator[tuple[str, Callable[[Index], torch.Tensor]]]


@dataclass(frozen=True)
class Piece:
    """Rows [start, end) of our parameter `target` come from `source` of a stored tensor."""

    target: str
    start: int
    end: int
    source: Index = ()
    zero: bool = False  # zeros instead (a row-parallel bias on ranks > 0: the all-reduce adds rank 0's)


def weight_pieces(model: LlamaForCausalLM) -> dict[str, list[Piece]]:
    """HF name (without `model.`) -> the pieces of our parameters it fills, for this model's
    tensor-parallel shard (all of each at one rank). Names not listed load whole, unsliced."""
    cfg, shard = model.cfg, model.shard
    d, hidden = cfg.head_dim, cfg.hidden_size
    (h0, h1), (k0, k1) = shard.heads(cfg), shard.kv_heads(cfg)
    (i0, i1), (v0, v1) = shard.intermediate(cfg), shard.vocab(cfg)
    q, kv, inter = (h1 - h0) * d, (k1 - k0) * d, i1 - i0  # this rank's sizes
    full_q, full_kv, full_inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    q_rows, kv_rows = slice(h0 * d, h1 * d), slice(k0 * d, k1 * d)
    out: dict[str, list[Piece]] = {}
    for i in range(cfg.num_layers):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        for kind in ("weight", "bias"):
            qkv = f"{attn}.qkv_proj.{kind}"
            out[f"{attn}.q_proj.{kind}"] = [Piece(qkv, 0, q, (q_rows,))]
            out[f"{attn}.k_proj.{kind}"] = [Piece(qkv, q, q + kv, (kv_rows,))]
            out[f"{attn}.v_proj.{kind}"] = [Piece(qkv, q + kv, q + 2 * kv, (kv_rows,))]
            out[qkv] = [  # Phi-3: stored fused, rows q | k | v
                Piece(qkv, 0, q, (q_rows,)),
                Piece(qkv, q, q + kv, (slice(full_q + k0 * d, full_q + k1 * d),)),
                Piece(qkv, q + kv, q + 2 * kv, (slice(full_q + full_kv + k0 * d, full_q + full_kv + k1 * d),)),
            ]
        gate_up = f"{mlp}.gate_up_proj.weight"
        out[f"{mlp}.gate_proj.weight"] = [Piece(gate_up, 0, inter, (slice(i0, i1),))]
        out[f"{mlp}.up_proj.weight"] = [Piece(gate_up, inter, 2 * inter, (slice(i0, i1),))]
        out[gate_up] = [  # Phi-3: stored fused, rows gate | up
            Piece(gate_up, 0, inter, (slice(i0, i1),)),
            Piece(gate_up, inter, 2 * inter, (slice(full_inter + i0, full_inter + i1),)),
        ]
        out[f"{attn}.o_proj.weight"] = [Piece(f"{attn}.o_proj.weight", 0, hidden, (slice(None), q_rows))]
        out[f"{attn}.o_proj.bias"] = [Piece(f"{attn}.o_proj.bias", 0, hidden, zero=shard.rank > 0)]
        out[f"{mlp}.down_proj.weight"] = [Piece(f"{mlp}.down_proj.weight", 0, hidden, (slice(None), slice(i0, i1)))]
        if cfg.moe_layer(i):
            out.update(_moe_pieces(cfg, shard, mlp))
    for name in ("embed_tokens.weight", "lm_head.weight"):
        out[name] = [Piece(name, 0, v1 - v0, (slice(v0, v1),))]
    return out


def _moe_pieces(cfg: ModelConfig, shard: TensorParallelShard, mlp: str) -> dict[str, list[Piece]]:
    """A mixture-of-experts layer's names (`mlp`: layers.i.mlp) -> pieces: every expert's under
    each name a checkpoint may use, none for those another rank holds (nor for the shared
    expert past rank 0)."""
    hidden, inter = cfg.hidden_size, cfg.expert_intermediate_size
    (e0, e1), out = shard.experts(cfg), {}
    moe = mlp.replace(".mlp", ".block_sparse_moe")  # Mixtral's names
    out[f"{moe}.gate.weight"] = [Piece(f"{mlp}.gate.weight", 0, cfg.num_experts)]
    stacked_gate_up: list[Piece] = []
    stacked_down: list[Piece] = []
    for e in range(cfg.num_experts):
        gate_up, down = f"{mlp}.experts.{e}.gate_up_proj.weight", f"{mlp}.experts.{e}.down_proj.weight"
        held = e0 <= e < e1
        gate, up, down_piece = (
            ([Piece(gate_up, 0, inter)], [Piece(gate_up, inter, 2 * inter)], [Piece(down, 0, hidden)])
            if held
            else ([], [], [])
        )
        for prefix in (f"{mlp}.experts.{e}", f"{moe}.experts.{e}"):
            out[f"{prefix}.gate_proj.weight"] = out[f"{prefix}.w1.weight"] = gate
            out[f"{prefix}.up_proj.weight"] = out[f"{prefix}.w3.weight"] = up
            out[f"{prefix}.down_proj.weight"] = out[f"{prefix}.w2.weight"] = down_piece
        if held:
            stacked_gate_up.append(Piece(gate_up, 0, 2 * inter, (e,)))
            stacked_down.append(Piece(down, 0, hidden, (e,)))
    out[f"{mlp}.experts.gate_up_proj"], out[f"{mlp}.experts.down_proj"] = stacked_gate_up, stacked_down
    if cfg.shared_expert_intermediate_size and shard.rank > 0:
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{mlp}.shared_expert.{name}.weight"] = []
        out[f"{mlp}.shared_expert_gate.weight"] = []
    elif cfg.shared_expert_intermediate_size:
        shared = cfg.shared_expert_intermediate_size
        fused = f"{mlp}.shared_expert.gate_up_proj.weight"
        out[f"{mlp}.shared_expert.gate_proj.weight"] = [Piece(fused, 0, shared)]
        out[f"{mlp}.shared_expert.up_proj.weight"] = [Piece(fused, shared, 2 * shared)]
    return out


def _safetensors_source(folder: Path) -> TensorSource:
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():

                def read(index: Index, name: str = hf_name) -> torch.Tensor:
                    return f.get_slice(name)[index] if index else f.get_tensor(name)  # only the slice's bytes

                yield hf_name, read


def _gguf_source(path: Path, cfg: ModelConfig) -> TensorSource:
    from pdserve.engine.gguf_weights import gguf_tensors

    for hf_name, tensor in gguf_tensors(path, cfg):

        def read(index: Index, t=tensor) -> torch.Tensor:
            return t.dequantize()[index]  # every quant type to float, for now (exact)

        yield hf_name, read


def load_weights(model: LlamaForCausalLM, path: str | Path, show_progress: bool = True) -> None:
    """`path`: an HF folder (safetensors) or a GGUF file."""
    path = Path(path)
    # linears kept as a GGUF file's blocks (models/quantized_linear.py) have their weights already
    kept = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    params = {
        n: p
        for n, p in model.named_parameters(remove_duplicate=False)
        if n.endswith(".bias") or f"{n.rpartition('.')[0]}.weight" not in kept
    }
    pieces = weight_pieces(model)
    covered: dict[str, int] = {name: 0 for name in params}  # rows loaded per parameter
    tied = getattr(model.cfg, "tie_word_embeddings", False)
    unexpected: list[str] = []
    source = _gguf_source(path, model.cfg) if is_gguf(path) else _safetensors_source(path)
    with (
        torch.no_grad(),
        tqdm(desc=f"loading {path.name}", unit="tensor", disable=not show_progress, leave=False) as bar,
    ):
        for hf_name, read in source:
            bar.update(1)
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            name = hf_name.removeprefix("model.")
            if name in pieces:
                todo = pieces[name]
            elif name in params:
                todo = [Piece(name, 0, params[name].shape[0])]
            elif name in kept:
                continue  # its blocks are loaded already (not dequantized)
            else:
                unexpected.append(hf_name)
                continue
            if all(p.target in kept for p in todo):
                continue  # its blocks are loaded already (not dequantized)
            if any(p.target not in params for p in todo):
                unexpected.append(hf_name)  # e.g. a bias for a bias-free layer
                continue
            for p in todo:
                dest = params[p.target][p.start : p.end]
                if p.zero:
                    dest.zero_()
                else:
                    tensor = read(p.source)
                    if tensor.shape != dest.shape:
                        raise WeightLoadError(
                            f"{hf_name}: checkpoint shape {tuple(tensor.shape)} (slice {p.source}) != expected "
                            f"{tuple(dest.shape)} in {path}"
                        )
                    dest.copy_(tensor.to(dest.dtype))
                covered[p.target] += p.end - p.start
    if unexpected:
        raise WeightLoadError(f"{len(unexpected)} unexpected tensors in {path}: {unexpected[:8]}")
    if tied and "lm_head.weight" in covered and covered["lm_head.weight"] == 0:
        covered["lm_head.weight"] = covered.get("embed_tokens.weight", 0)
    incomplete = [n for n, rows in covered.items() if rows != params[n].shape[0]]
    if incomplete:
        raise WeightLoadError(f"missing weights in {path}: {incomplete[:8]}" + (" ..." if len(incomplete) > 8 else ""))
