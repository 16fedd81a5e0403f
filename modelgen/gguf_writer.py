"""Write an HF model folder (ours: make_model's random models) as one GGUF file, as llama.cpp's
convert_hf_to_gguf.py lays it out: llama.cpp's tensor names (gguf's own name map), q/k rows
permuted for the llama architecture, 1-D tensors in F32, 2-D ones in the chosen type, and the
tokenizer (byte-level BPE: tokens, types, merges, special ids) and chat template as metadata.
Gemma 2 / 3: norm weights stored as 1 + w, windows, soft-caps and Gemma 3's local rope base as
metadata; a model whose attention scale llama.cpp would derive differently is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from pdserve.engine.config import ModelConfig
from pdserve.engine.weights import safetensors_files
from pdserve.modelgen.gguf_kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k

# our architecture -> llama.cpp's (Mistral v0.1-style models convert as llama)
GGUF_ARCH = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,  # llama.cpp converts Mixtral as llama with experts
}
# an expert's weight (Qwen-MoE names, Mixtral's w1/w3/w2) -> its stacked tensor's kind
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_KINDS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # kept F32, as llama-quantize keeps them
Q = gguf.GGMLQuantizationType
# --gguf TYPE -> the type of 2-D weights (the gguf package quantizes the legacy types; K-quants
# come from modelgen/gguf_kquants.py). q4_k_m: Q4_K, with attn_v, ffn_down and the output in Q6_K
# (the mix of llama.cpp's Q4_K_M, which varies it by layer)
WRITE_TYPES = {
    "f32": Q.F32,
    "f16": Q.F16,
    "bf16": Q.BF16,
    "q8_0": Q.Q8_0,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q4_k": Q.Q4_K,
    "q5_k": Q.Q5_K,
    "q6_k": Q.Q6_K,
    "q4_k_m": Q.Q4_K,
}
_MIX_Q6_K = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight", "output.weight")  # q4_k_m's Q6_K tensors
_K_WRITERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}
_FILE_TYPES = {
    Q.F32: gguf.LlamaFileType.ALL_F32,
    Q.F16: gguf.LlamaFileType.MOSTLY_F16,
    Q.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
    Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
    Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    Q.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M,
    Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture: within each head, HF's rotate-half
    pairs (i, i + d/2) become adjacent rows (2i, 2i + 1). w: [n_head * d, ...] (weight or bias)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: str | Path, out: str | Path, qtype: str = "f32", show_progress: bool = False) -> Path:
    """Write `folder` (an HF model folder) to the GGUF file `out`; returns its path."""
    if qtype not in WRITE_TYPES:
        raise ValueError(f"unsupported GGUF type {qtype!r}; choose {', '.join(WRITE_TYPES)}")
    folder, out = Path(folder), Path(out)
    cfg = ModelConfig.from_folder(folder, "native")  # llama.cpp's names map the native families only
    if cfg.rope.kind not in ("default", "linear"):  # llama3 / longrope factors travel as extra tensors
        raise ValueError(f"writing GGUF with rope scaling {cfg.rope.kind!r} is not supported")
    arch = GGUF_ARCH[cfg.architecture]
    gemma = cfg.family == "gemma"
    wtype = WRITE_TYPES[qtype]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    _write_config(writer, cfg, folder.name, wtype)
    if gemma:
        _write_gemma_config(writer, cfg)
    _write_tokenizer(writer, folder, cfg)
    names = gguf.get_tensor_name_map(arch, cfg.num_layers)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}  # (layer, gate/up/down) -> expert -> [out, in]
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in tqdm(f.keys(), desc=f"writing {out.name}", disable=not show_progress, leave=False):
                expert = _EXPERT.fullmatch(hf_name)
                if expert is not None:
                    kind = _EXPERT_KINDS[expert.group(3)]
                    experts.setdefault((int(expert.group(1)), kind), {})[int(expert.group(2))] = (
                        f.get_tensor(hf_name).to(torch.float32).numpy()
                    )
                    continue
                name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ValueError(f"{hf_name}: no GGUF name for it in llama.cpp's {arch.name} map")
                data = f.get_tensor(hf_name).to(torch.float32).numpy()
                if gemma and hf_name.endswith("norm.weight"):
                    data = data + 1.0  # llama.cpp's converter: Gemma's RMSNorm scales by (1 + w)
                if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                    data = llama_permute(data, cfg.num_heads)
                elif arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                    data = llama_permute(data, cfg.num_kv_heads)
                mixed = qtype == "q4_k_m" and name.endswith(_MIX_Q6_K)
                _add_tensor(writer, name, data, Q.F32 if name.endswith(_ROUTERS) else Q.Q6_K if mixed else wtype)
    for (layer, kind), per_expert in sorted(experts.items()):  # stacked [E, out, in], as llama.cpp's converter
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
        mixed = qtype == "q4_k_m" and name.endswith(_MIX_Q6_K)
        _add_tensor(writer, name, np.stack([per_expert[e] for e in range(len(per_expert))]), Q.Q6_K if mixed else wtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=show_progress)
    writer.close()
    return out


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, wtype: gguf.GGMLQuantizationType) -> None:
    """1-D tensors (norms, biases) stay F32, as llama.cpp keeps them; so does a 2-D tensor whose
    rows are not whole blocks of `wtype`."""
    block = gguf.GGML_QUANT_SIZES[wtype][0]
    if data.ndim < 2 or data.shape[-1] % block:
        wtype = Q.F32
    if wtype == Q.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif wtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    elif wtype in _K_WRITERS:  # (rows of any leading shape: stacked experts' [E, out, in])
        rows = _K_WRITERS[wtype](data.reshape(-1, data.shape[-1]))
        writer.add_tensor(name, rows.reshape(*data.shape[:-1], rows.shape[-1]), raw_dtype=wtype)
    else:  # uint8 blocks; the writer recovers the element shape from the type
        writer.add_tensor(name, gguf.quants.quantize(data, wtype), raw_dtype=wtype)


def _write_config(writer: gguf.GGUFWriter, cfg: ModelConfig, name: str, wtype: gguf.GGMLQuantizationType) -> None:
    writer.add_name(name)
    writer.add_file_type(_FILE_TYPES[wtype])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope.theta)
    writer.add_rope_dimension_count(cfg.rotary_dims)
    if cfg.rope.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope.factor)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.experts_per_token)
        writer.add_expert_feed_forward_length(cfg.expert_intermediate_size)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
        if cfg.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _write_gemma_config(writer: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """What llama.cpp reads of a gemma2 / gemma3 file beyond the common keys."""
    from pdserve.engine.gguf_file import GEMMA_27B_LAYERS

    arch = "gemma2" if cfg.architecture == "Gemma2ForCausalLM" else "gemma3"
    scalar = cfg.hidden_size // cfg.num_heads if cfg.num_layers == GEMMA_27B_LAYERS[arch] else cfg.head_dim
    if cfg.attn_scale is None or abs(cfg.attn_scale - scalar**-0.5) > 1e-9:
        raise ValueError(
            f"query_pre_attn_scalar {cfg.attn_scale and cfg.attn_scale**-2:.0f}: llama.cpp derives {scalar} "
            "for this shape (GGUF has no key for it)"
        )
    if cfg.attn_softcap is not None:
        writer.add_attn_logit_softcapping(cfg.attn_softcap)
    if cfg.final_softcap is not None:
        writer.add_final_logit_softcapping(cfg.final_softcap)
    if cfg.layer_windows:
        writer.add_sliding_window(max(cfg.layer_windows))
        writer.add_sliding_window_pattern([w > 0 for w in cfg.layer_windows])
    if cfg.local_rope is not None:
        if cfg.local_rope.kind != "default":
            raise ValueError(f"Gemma 3's sliding layers' rope scaling {cfg.local_rope.kind!r} has no GGUF key")
        writer.add_rope_freq_base_swa(cfg.local_rope.theta)


def _write_tokenizer(writer: gguf.GGUFWriter, folder: Path, cfg: ModelConfig) -> None:
    """Byte-level BPE as llama.cpp stores it (tokenizer model `gpt2`, GPT-2's split regex)."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers are written to GGUF, not {model.get('type')!r}")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = [""] * cfg.vocab_size  # embedding rows past the tokenizer's vocab are unused
    types = [gguf.TokenType.UNUSED] * cfg.vocab_size
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = gguf.TokenType.CONTROL if tok in special else gguf.TokenType.NORMAL
    for i, tok in enumerate(tokens):
        if not tok:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    for key, add in (
        ("eos_token", writer.add_eos_token_id),
        ("bos_token", writer.add_bos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if tok_cfg.get(key) in vocab:
            add(vocab[tok_cfg[key]])
    writer.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    if tok_cfg.get("chat_template"):
        writer.add_chat_template(tok_cfg["chat_template"])
