"""Random HF folders of the sizes CPU users run, written a tensor at a time (`make-model --stream`):
the same config, tokenizer and per-parameter draws as make_model.py, but the model is only built on
the meta device for its names and shapes, each tensor is drawn, cast to bf16 and written into
sharded safetensors one shard at a time, so a 10 B-parameter mixture is written with a shard's
memory. A mixture's experts are written as the hub stores them, one tensor per expert (Qwen-MoE's
`mlp.experts.e.{gate,up,down}_proj`, Mixtral's `block_sparse_moe.experts.e.w1/w3/w2`), which is what
llama.cpp's converter reads. The values are make_model's distributions, not its bytes (it draws
stacked experts whole, in fp32)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from pdserve.modelgen.make_model import PRESETS, _hf_config, draw_weight
from pdserve.modelgen.tokenizer_builder import EOS, build_tokenizer

Shape = tuple[int, ...]


def hub_tensors(name: str, shape: Shape, arch: str) -> Iterator[tuple[str, Shape]]:
    """One parameter of transformers' model -> the tensors a hub checkpoint stores for it."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        experts, rows, cols = shape
        stem = name.rpartition(".")[0]  # model.layers.i.mlp.experts
        if arch == "mixtral":
            stem = stem.replace(".mlp.", ".block_sparse_moe.")
        kinds = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if arch == "mixtral" else {}
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        for e in range(experts):
            for part in parts:
                yield f"{stem}.{e}.{kinds.get(part, part)}.weight", (rows // len(parts), cols)
        return
    if arch == "mixtral" and name.endswith("mlp.gate.weight"):
        name = name.replace(".mlp.", ".block_sparse_moe.")
    yield name, shape


def write_streamed(
    out_dir: str | Path,
    preset: str,
    arch: str,
    seed: int = 0,
    shard_gb: float = 2.0,
    hf_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write the folder (bf16 shards); returns its path."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    tmp = out.parent / f".{out.name}-stream"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    p = replace(PRESETS[preset], **overrides)
    vocab = build_tokenizer(tmp, p.vocab_size, seed=0)
    vocab = max(vocab, p.vocab_size) if p.pad_vocab else vocab
    eos_id = Tokenizer.from_file(str(tmp / "tokenizer.json")).token_to_id(EOS)
    assert eos_id is not None, f"{EOS} missing from the tokenizer just built"
    cfg = _hf_config(arch, p, vocab, eos_id, None, hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = sorted(t for n, p_ in model.named_parameters() for t in hub_tensors(n, tuple(p_.shape), arch))
    shards: list[list[tuple[str, Shape]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_gb * 1e9:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        drawn = {n: draw_weight(n, s, gen).to(torch.bfloat16) for n, s in shard}
        save_file(drawn, str(tmp / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(drawn, file))
        print(f"  {file}: {len(drawn)} tensors ({time.perf_counter() - t0:.0f} s)", flush=True)
    total = sum(2 * math.prod(s) for _, s in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    cfg.architectures = [type(model).__name__]
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(tmp)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False).save_pretrained(
        tmp
    )
    (tmp / "pdserve_model.json").write_text(
        json.dumps({"preset": preset, "arch": arch, "seed": seed, "parameters": total // 2, "streamed": True})
    )
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"wrote {arch}/{preset} ({total / 2e9:.2f} B parameters, bf16) to {out}", flush=True)
    return out
