"""`--model` as a GGUF file: its config and tokenizer (chat template included), its header read by
engine/gguf_reader.py (ggml's own reader took seconds a process for a Llama 3 tokenizer). Torch-free: the gateway reads the config through ModelConfig.from_folder.
The weights are engine/gguf_weights.py's.

GGUF key ({arch}.*)                         -> ModelConfig field
embedding_length / feed_forward_length      -> hidden_size / intermediate_size
block_count, attention.head_count(_kv)      -> num_layers, num_heads, num_kv_heads
attention.key_length (else hidden / heads)  -> head_dim
rope.dimension_count (< head_dim)           -> rotary_dim (partial rotary)
rope.freq_base, rope.scaling.{type,factor}  -> rope (none or linear)
tensors output.weight / blk.0.attn_q.bias / blk.0.attn_output.bias / blk.0.attn_q_norm.weight
                                            -> untied lm_head, qkv_bias, o_bias, qk_norm
tokenizer.ggml.{eos,eot,eom}_token_id      -> eos_token_ids
expert_count, expert_used_count,           -> num_experts, experts_per_token (llama + experts: Mixtral)
expert_(shared_)feed_forward_length         -> expert_ / shared_expert_intermediate_size
expert_weights_norm (else llama.cpp's rule) -> norm_topk_prob; layers without ffn_gate_inp: dense
Gemma 2 / 3 (family gemma): attention.sliding_window (+ sliding_window_pattern, else llama.cpp's
2 / 6), attn_logit_softcapping, final_logit_softcapping, rope.freq_base_swa (Gemma 3's sliding
layers; llama.cpp's default 10000), the attention scale as llama.cpp derives it (head_dim, or
hidden / heads for the 27B shapes), norm weights stored as 1 + w by llama.cpp's converter.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.gguf_reader import GgufFile

# GGUF general.architecture -> ours (llama.cpp converts Mistral v0.1-style models as llama)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# llama.cpp's top-k renormalisation where the file has no expert_weights_norm key (its build_moe_ffn
# calls: qwen3moe and Mixtral-as-llama renormalise, qwen2moe does not)
EXPERT_WEIGHTS_NORM = {"qwen2moe": False, "qwen3moe": True, "llama": True}
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's defaults: every n-th layer full
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales q by (hidden / heads) ** -0.5 there
_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """A file that starts with GGUF's magic (a folder, or any other file, is not)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC


@lru_cache(maxsize=4)
def open_gguf(path: str) -> "GgufFile":
    """The file's header (memory-mapped: tensor data is read when touched). Kept for the config,
    tokenizer and weights readers of one start; `release_gguf` drops it once the weights are in."""
    from pdserve.engine.gguf_reader import GgufFile

    return GgufFile(path)


def release_gguf() -> None:
    """Forget the open readers (their maps go once nothing else holds them): every page of the
    file the loader touched would otherwise stay in the process's resident memory beside the
    weights copied out of it (a Q8_0 1B file: 1.0 GB more)."""
    open_gguf.cache_clear()


def metadata(reader: "GgufFile", key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(path: str | Path) -> "ModelConfig":
    from pdserve.engine.config import ModelConfig, RopeConfig

    reader = open_gguf(str(path))
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        value = metadata(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata {arch}.{name} missing")
        return value

    if "rope_freqs.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise ValueError(f"{path}: per-frequency RoPE factors (llama3 / longrope scaling) are not served from GGUF")
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{path}: GGUF rope scaling {scaling!r} is not supported (none, linear)")
    if arch not in GEMMA_SWA_PATTERN and metadata(reader, f"{arch}.attention.sliding_window") is not None:
        raise ValueError(f"{path}: sliding-window attention is not served from a {arch} GGUF file")
    hidden, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rotary = int(key("rope.dimension_count", head_dim))
    num_layers = int(key("block_count"))
    ends = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    gemma = _gemma_fields(reader, arch, num_layers, hidden // num_heads, head_dim) if arch in GEMMA_SWA_PATTERN else {}
    moe = _moe_fields(reader, arch, num_layers, tensors) if metadata(reader, f"{arch}.expert_count") else {}
    architecture = "MixtralForCausalLM" if arch == "llama" and moe else ARCHITECTURES[arch]
    return ModelConfig(
        path=str(path),
        architecture=architecture,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes: innermost first
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope=RopeConfig(
            theta=float(key("rope.freq_base", 10000.0)),
            kind="linear" if scaling == "linear" else "default",
            factor=float(key("rope.scaling.factor", 1.0)),
        ),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in ends if e is not None)),
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rotary_dim=None if rotary == head_dim else rotary,
        weights_tag=weight_types(reader),
        **gemma,
        **moe,
    )


def _moe_fields(reader: "GgufFile", arch: str, num_layers: int, tensors: dict[str, Any]) -> dict:
    """ModelConfig's mixture-of-experts fields, as llama.cpp reads them."""
    if arch not in EXPERT_WEIGHTS_NORM:
        raise ValueError(f"experts in a {arch} GGUF file are not served")
    ff = metadata(reader, f"{arch}.expert_feed_forward_length") or metadata(reader, f"{arch}.feed_forward_length")
    return dict(
        num_experts=int(metadata(reader, f"{arch}.expert_count")),
        experts_per_token=int(metadata(reader, f"{arch}.expert_used_count")),
        expert_intermediate_size=int(ff),
        norm_topk_prob=bool(metadata(reader, f"{arch}.expert_weights_norm", EXPERT_WEIGHTS_NORM[arch])),
        shared_expert_intermediate_size=int(metadata(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0),
        dense_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors),
    )


def _gemma_fields(reader: "GgufFile", arch: str, num_layers: int, per_head: int, head_dim: int) -> dict:
    """ModelConfig's Gemma fields, as llama.cpp reads a gemma2 / gemma3 file."""
    from pdserve.engine.config import RopeConfig

    window = int(metadata(reader, f"{arch}.attention.sliding_window", 0) or 0)
    pattern = metadata(reader, f"{arch}.attention.sliding_window_pattern", GEMMA_SWA_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer: sliding or not
        sliding = [bool(x) for x in pattern][:num_layers]
    else:  # every n-th layer full (llama.cpp's set_swa_pattern)
        sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(num_layers)]
    windows = tuple(window if s else 0 for s in sliding) if window else ()
    scalar = per_head if num_layers == GEMMA_27B_LAYERS[arch] else head_dim
    local = None
    if arch == "gemma3":
        local = RopeConfig(theta=float(metadata(reader, f"{arch}.rope.freq_base_swa", 10000.0)))
    return dict(
        family="gemma",
        layer_windows=windows if any(windows) else (),
        attn_softcap=metadata(reader, f"{arch}.attn_logit_softcapping") if arch == "gemma2" else None,
        final_softcap=metadata(reader, f"{arch}.final_logit_softcapping"),
        attn_scale=float(scalar) ** -0.5,
        local_rope=local,
        norms_plus_one=True,
    )


def weight_types(reader: "GgufFile") -> str:
    """The file's tensor types, most common first (e.g. `Q4_0+F32`): part of the model fingerprint,
    so workers that load different quantizations of one model never share KV."""
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    return "gguf-" + "+".join(name for name, _ in counts.most_common())


def unrendered_token_ids(model: str | Path) -> frozenset[int]:
    """Ids of a GGUF file's UNUSED-type tokens (what a converter pads a vocabulary with), which
    llama.cpp renders as no text; none for an HF folder. transformers' conversion decodes them as
    their placeholder strings ("[PAD123]"), so the gateway drops them from the text itself."""
    path = Path(model)
    if not is_gguf(path):
        return frozenset()
    import gguf
    import numpy as np

    from pdserve.engine.gguf_reader import GgufFile

    field = GgufFile(path).fields.get("tokenizer.ggml.token_type")
    if field is None:
        return frozenset()
    types = np.asarray(field.contents())
    return frozenset(np.flatnonzero(types == int(gguf.TokenType.UNUSED)).tolist())


def load_tokenizer(model: str | Path) -> "PreTrainedTokenizerBase":
    """The tokenizer (and chat template) of `--model`: an HF folder, or a GGUF file's metadata
    (transformers builds it, once per file: `_converted_tokenizer`)."""
    from transformers import AutoTokenizer

    path = Path(model)
    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(str(model))
    try:
        return _converted_tokenizer(path)
    except OSError:  # no writable cache: convert here
        return _convert_tokenizer(path)


def _convert_tokenizer(path: Path) -> "PreTrainedTokenizerBase":
    """transformers' conversion of the file's tokenizer metadata (its GGUF reader: 17 s of CPU for a
    Llama 3 vocabulary on a loaded 2-core machine)."""
    from transformers import AutoTokenizer

    # From an empty folder: transformers mixes in the file's folder's tokenizer_config.json, if any
    # (one beside the GGUF left it with no chat template and no EOS).
    with tempfile.TemporaryDirectory() as empty:
        return AutoTokenizer.from_pretrained(empty, gguf_file=str(path.resolve()))


def _converted_tokenizer(path: Path) -> "PreTrainedTokenizerBase":
    """The converted tokenizer, saved under the cache (PDSERVE_CACHE_DIR) for this file (its path,
    size and mtime) and transformers version: the gateway and each worker of a start, and every
    restart, load it in a fraction of a second. A lock makes one process convert while the others
    of a start wait for it."""
    import transformers
    from transformers import AutoTokenizer

    from pdserve.env import settings

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    folder = settings().model_cache_dir / "gguf-tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(folder))
        tokenizer = _convert_tokenizer(path)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        tokenizer.save_pretrained(str(partial))
        os.replace(partial, folder)  # whole or absent
        return tokenizer
