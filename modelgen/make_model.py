"""Random-initialised Hugging Face model folders (Llama / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3,
Qwen2-MoE / Qwen3-MoE / Mixtral,
and the transformers-backend families of modelgen/make_model_families.py), made offline and
deterministically, through transformers' own config and model classes.

`pdserve serve` with no --model uses `default_model_path()`: the ~30M-parameter `default`
preset, built once (a few seconds) and cached. Tests use `tiny` (and `real`, a real small
model's shape, where step costs matter); benchmarks use `bench`.
Weights are drawn so logits are well spread (random HF-style init at std 0.02 gives nearly
equal logits, and greedy argmax would hinge on float rounding between implementations).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pdserve.env import settings
from pdserve.modelgen.make_model_families import (
    GEMMA_ARCHS,
    GEMMA_TINY_WINDOW,
    MOE_ARCHS,
    TRANSFORMERS_ARCHS,
    gemma_family_config,
    gemma_rescale_weights,
    moe_family_config,
    shape_fields,
    transformers_family_config,
)
from pdserve.modelgen.tokenizer_builder import EOS, build_tokenizer

DEFAULT_MODEL_NAME = "default-v1"


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    head_dim: int | None = None  # None: hidden_size // num_heads (qwen3: twice that, as in Qwen3)
    # the embedding and LM head get vocab_size rows even past the tokenizer's tokens (which the
    # synthetic corpus caps near 15k), as real checkpoints pad theirs: a 128k head's real cost
    pad_vocab: bool = False
    # a mixture's (experts, experts a token, expert width) for the MoE archs; None: their tiny defaults
    experts: tuple[int, int, int] | None = None


PRESETS = {
    "tiny": ModelPreset(64, 2, 4, 2, 128, 512, 1024),
    "bench": ModelPreset(512, 8, 8, 4, 1536, 8192, 4096),
    # a real small model's shape (SmolLM-135M: 30 layers, hidden 576, vocab 49152): its prefill
    # takes seconds here, so overload tests see what real models cost
    "real": ModelPreset(576, 30, 9, 3, 1536, 49152, 2048),
    # the sizes CPU users run (shapes of Llama-3.2-1B / -3B and Llama-3.1-8B; random weights):
    # speed and memory at size, not correctness (the small presets are for that)
    "llama3.2-1b": ModelPreset(2048, 16, 32, 8, 8192, 128256, 8192, True, 500000.0, 64, True),
    "llama3.2-3b": ModelPreset(3072, 28, 24, 8, 8192, 128256, 8192, True, 500000.0, 128, True),
    "llama3.1-8b": ModelPreset(4096, 32, 32, 8, 14336, 128256, 8192, False, 500000.0, 128, True),
    # Qwen3-30B-A3B's shape (--arch qwen3_moe; --layers to fit a machine, --stream to write it)
    "qwen3-30b-a3b": ModelPreset(2048, 48, 32, 4, 6144, 151936, 40960, False, 1000000.0, 128, True, (128, 8, 768)),
}
PRESETS["default"] = PRESETS["bench"]


ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    *MOE_ARCHS,
    *GEMMA_ARCHS,
    *TRANSFORMERS_ARCHS,
)  # the latter: modelgen/make_model_families.py


def _hf_config(
    arch: str, p: ModelPreset, vocab: int, eos_id: int, rope_scaling: dict | None, extra: dict[str, Any] | None = None
):
    """`extra`: more HF config fields (e.g. phi3's partial_rotary_factor, original_max_position_embeddings)."""
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    if arch in TRANSFORMERS_ARCHS:
        return transformers_family_config(arch, p, vocab, eos_id, {"rope_type": "default", "rope_theta": p.rope_theta})
    if arch in GEMMA_ARCHS:
        return gemma_family_config(arch, p, vocab, eos_id, extra or {})
    if arch in MOE_ARCHS:
        return moe_family_config(arch, p, vocab, eos_id, extra or {})
    common: dict[str, Any] = dict(
        **shape_fields(p, vocab, eos_id),
        intermediate_size=p.intermediate_size,
        rms_norm_eps=1e-5,
        torch_dtype="float32",
        **(extra or {}),
    )
    head_dim = p.head_dim or p.hidden_size // p.num_heads
    rope = {"rope_type": "default", "rope_theta": p.rope_theta, **(rope_scaling or {})}
    cfg: LlamaConfig | MistralConfig | Qwen2Config | Qwen3Config | Phi3Config
    if arch == "llama":
        cfg = LlamaConfig(**common, attention_bias=False, mlp_bias=False, head_dim=head_dim)
    elif arch == "qwen2":
        common.setdefault("use_sliding_window", False)
        cfg = Qwen2Config(**common)
    elif arch == "mistral":  # every layer windowed: prompts of tests cross the window
        common.setdefault("sliding_window", GEMMA_TINY_WINDOW)
        cfg = MistralConfig(**common, head_dim=head_dim)
    elif arch == "qwen3":
        common.setdefault("attention_bias", False)
        common.setdefault("use_sliding_window", False)
        cfg = Qwen3Config(**common, head_dim=p.head_dim or 2 * p.hidden_size // p.num_heads)
    elif arch == "phi3":
        cfg = Phi3Config(**common)  # fused qkv_proj / gate_up_proj; head_dim is hidden // heads
    else:
        raise ValueError(f"unknown arch {arch!r}; choose {', '.join(ARCHS)}")
    # transformers >= 5 reads rope_parameters (keeping what the config put there, e.g. phi3's
    # partial_rotary_factor); older versions rope_theta/rope_scaling.
    if hasattr(cfg, "rope_parameters"):
        cfg.rope_parameters = {**(cfg.rope_parameters or {}), **rope}
    else:
        cfg.rope_theta = p.rope_theta
        cfg.rope_scaling = rope_scaling
    return cfg


def draw_weight(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One parameter's random values (fp32), by its name: norms near 1, biases small, embeddings
    and LM head at std 0.5, linears [out, in] (or stacked experts' [E, out, in]) at 1/sqrt(in)."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(("embed_tokens.weight", "lm_head.weight", "embed_in.weight", "embed_out.weight")):
        return 0.5 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        param.copy_(draw_weight(name, tuple(param.shape), gen))


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    max_shard_size: str | None = None,
    quiet: bool = False,
    **overrides,
) -> Path:
    """Write an HF folder; returns its path. Same arguments -> byte-identical weights."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose {', '.join(PRESETS)}")
    rope_scaling = overrides.pop("rope_scaling", None)
    hf_extra = overrides.pop("hf_config", None)  # more HF config fields, passed through
    p = replace(PRESETS[preset], **overrides)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent if out_dir.parent.exists() else None))
    try:
        vocab = build_tokenizer(tmp, p.vocab_size, seed=0)
        if p.pad_vocab:
            vocab = max(vocab, p.vocab_size)
        from tokenizers import Tokenizer

        eos_id = Tokenizer.from_file(str(tmp / "tokenizer.json")).token_to_id(EOS)
        assert eos_id is not None, f"{EOS} missing from the tokenizer just built"
        cfg = _hf_config(arch, p, vocab, eos_id, rope_scaling, hf_extra)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _init_weights(model, seed)
        if arch in GEMMA_ARCHS:
            gemma_rescale_weights(model)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(tmp, **kwargs)
        GenerationConfig(
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
        ).save_pretrained(tmp)
        n_params = sum(t.numel() for t in model.parameters())
        (tmp / "pdserve_model.json").write_text(
            json.dumps({"preset": preset, "arch": arch, "seed": seed, "parameters": n_params}, indent=2)
        )
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"wrote {arch}/{preset} model ({n_params / 1e6:.1f}M parameters) to {out_dir}", flush=True)
    return out_dir


def default_model_path() -> Path:
    """The embedded default model, created on first use (process-safe) and cached."""
    root = settings().model_cache_dir / "models"
    path = root / DEFAULT_MODEL_NAME
    if (path / "config.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            print(f"creating the default model at {path} (once)...", flush=True)
            make_model(path, preset="default", arch="llama", seed=0)
    return path


def make_model_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pdserve make-model",
        description="Write a random-initialised Hugging Face model folder (and, with --gguf, a GGUF file of it).",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--arch", default="llama", choices=list(ARCHS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default=None, help="e.g. 10MB: write sharded safetensors")
    ap.add_argument(
        "--gguf",
        default=None,
        metavar="TYPE",
        help="also write OUT/model-TYPE.gguf (f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1)",
    )
    ap.add_argument(
        "--eagle-for",
        default=None,
        metavar="TARGET_DIR",
        help="instead, write a random-initialised EAGLE-1 head for the Llama-family model in TARGET_DIR "
        '(vLLM\'s layout: fc + one decoder layer; --speculative-config \'{"method": "eagle", ...}\')',
    )
    ap.add_argument(
        "--stream",
        action="store_true",
        help="write bf16 shards a tensor at a time (sizes that do not fit in memory; modelgen/streamed_model.py)",
    )
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--hf-config", default=None, metavar="JSON", help="more HF config fields, e.g. num_experts")
    tie = ap.add_mutually_exclusive_group()
    tie.add_argument("--tie", dest="tie", action="store_true", default=None)
    tie.add_argument("--no-tie", dest="tie", action="store_false")
    args = ap.parse_args(argv)
    if args.eagle_for is not None:
        from pdserve.modelgen.make_eagle_head import make_eagle_head

        print(f"wrote an EAGLE head to {make_eagle_head(args.eagle_for, args.out, args.seed)}", flush=True)
        return 0
    overrides: dict[str, Any] = {} if args.tie is None else {"tie_word_embeddings": args.tie}
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    if args.hf_config is not None:
        overrides["hf_config"] = json.loads(args.hf_config)
    if args.stream:
        from pdserve.modelgen.streamed_model import write_streamed

        write_streamed(args.out, args.preset, args.arch, args.seed, **overrides)
        return 0
    if args.gguf is not None:
        from pdserve.modelgen.gguf_writer import WRITE_TYPES

        if args.gguf not in WRITE_TYPES:
            ap.error(f"--gguf {args.gguf}: choose {', '.join(WRITE_TYPES)}")
    out = make_model(args.out, args.preset, args.arch, args.seed, args.max_shard_size, **overrides)
    if args.gguf is not None:
        from pdserve.modelgen.gguf_writer import write_gguf

        print(f"wrote {write_gguf(out, out / f'model-{args.gguf}.gguf', args.gguf, show_progress=True)}", flush=True)
    return 0
