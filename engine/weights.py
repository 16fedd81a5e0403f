"""Load HF safetensors (single file or sharded), or a GGUF file (engine/gguf_weights.py: same
HF names), into the fused model, failing loudly.

HF name                                   -> our parameter (shard of a fused weight)
model.layers.i.self_attn.{q,k,v}_proj.*   -> layers.i.self_attn.qkv_proj.*   (rows q | k | v)
model.layers.i.mlp.{gate,up}_proj.weight  -> layers.i.mlp.gate_up_proj.weight (rows gate | up)
model.layers.i.self_attn.qkv_proj.weight,  -> the same names: Phi-3 stores them fused, in our row
model.layers.i.mlp.gate_up_proj.weight        order (q | k | v, gate | up), so they load whole
model.* / lm_head.weight                  -> same name without the `model.` prefix
Every parameter must be covered exactly; unknown, missing or mis-shaped tensors raise.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.engine.gguf_file import is_gguf
from pdserve.engine.models.quantized_linear import QuantizedLinear

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models.llama import LlamaForCausalLM

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
    for i, layer in enumerate(model.decoder_layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.q_size, attn.kv_size
        rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        for name, (a, b) in rows.items():
            for kind in ("weight", "bias"):
                out[f"layers.{i}.self_attn.{name}.{kind}"] = (f"layers.{i}.self_attn.qkv_proj.{kind}", a, b)
        inter = mlp.intermediate
        out[f"layers.{i}.mlp.gate_proj.weight"] = (f"layers.{i}.mlp.gate_up_proj.weight", 0, inter)
        out[f"layers.{i}.mlp.up_proj.weight"] = (f"layers.{i}.mlp.gate_up_proj.weight", inter, 2 * inter)
    return out


# (HF name, a thunk that reads it as a tensor): one per stored tensor, from whichever format
TensorSource = Iterator[tuple[str, Callable[[], torch.Tensor]]]


def _safetensors_source(folder: Path) -> TensorSource:
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                yield hf_name, partial(f.get_tensor, hf_name)


def _gguf_source(path: Path, cfg: ModelConfig) -> TensorSource:
    from pdserve.engine.gguf_weights import gguf_tensors

    for hf_name, tensor in gguf_tensors(path, cfg):
        yield hf_name, tensor.dequantize  # every quant type to float, for now (exact)


def load_weights(model: LlamaForCausalLM, path: str | Path, show_progress: bool = True) -> None:
    """`path`: an HF folder (safetensors) or a GGUF file."""
    path = Path(path)
    # linears kept as a GGUF file's blocks (models/quantized_linear.py) have their weights already
    kept = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    params = {
        n: p
        for n, p in model.named_parameters(remove_duplicate=False)
        if n.endswith(".bias") or f"{n.rpartition('.')[0]}.weight" not in kept
    }
    fused = fused_slices(model)
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
            if name in fused:
                target, a, b = fused[name]
            elif name in params:
                target, a, b = name, 0, params[name].shape[0]
            elif name in kept:
                continue  # its blocks are loaded already (not dequantized)
            else:
                unexpected.append(hf_name)
                continue
            if target in kept:
                continue  # its blocks are loaded already (not dequantized)
            if target not in params:
                unexpected.append(hf_name)  # e.g. a bias for a bias-free layer
                continue
            tensor = read()
            dest = params[target][a:b]
            if tensor.shape != dest.shape:
                raise WeightLoadError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)} in {path}"
                )
            dest.copy_(tensor.to(dest.dtype))
            covered[target] += b - a
    if unexpected:
        raise WeightLoadError(f"{len(unexpected)} unexpected tensors in {path}: {unexpected[:8]}")
    if tied and "lm_head.weight" in covered and covered["lm_head.weight"] == 0:
        covered["lm_head.weight"] = covered.get("embed_tokens.weight", 0)
    incomplete = [n for n, rows in covered.items() if rows != params[n].shape[0]]
    if incomplete:
        raise WeightLoadError(f"missing weights in {path}: {incomplete[:8]}" + (" ..." if len(incomplete) > 8 else ""))
