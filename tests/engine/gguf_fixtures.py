"""Tiny random models as GGUF files, and HF's reference for them: the HF model of the source
folder with every weight replaced by the GGUF's, dequantized to fp32."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_weights import gguf_tensors
from pdserve.modelgen.gguf_writer import write_gguf
from pdserve.modelgen.hf_state import copy_into_hf_state
from pdserve.modelgen.make_model import make_model

SEEDS = {"llama": 21, "qwen2": 22, "qwen3": 23, "phi3": 24}


def source_folder(root: Path, arch: str) -> Path:
    folder = root / f"src-{arch}"
    if not (folder / "config.json").is_file():
        make_model(folder, preset="tiny", arch=arch, seed=SEEDS[arch], quiet=True)
    return folder


def gguf_file(root: Path, arch: str, qtype: str) -> Path:
    """In a folder of its own: nothing beside it that a loader could read instead."""
    out = root / f"gguf-{arch}-{qtype}" / "model.gguf"
    if not out.is_file():
        write_gguf(source_folder(root, arch), out, qtype)
    return out


def dequantized_folder(root: Path, arch: str, qtype: str) -> Path:
    """An HF folder holding the GGUF's weights as fp32 (the reference HF generates from)."""
    from transformers import AutoModelForCausalLM

    out = root / f"deq-{arch}-{qtype}"
    if (out / "config.json").is_file():
        return out
    src, file = source_folder(root, arch), gguf_file(root, arch, qtype)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in gguf_tensors(file, ModelConfig.from_folder(file)):
            copy_into_hf_state(state, name, tensor.dequantize())
    model.save_pretrained(out)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / extra).write_bytes((src / extra).read_bytes())
    return out
