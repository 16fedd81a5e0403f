"""Typed, validated configuration: the model (read from an HF folder) and the engine knobs."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.flag import Flag, parse_size
from pdserve.protocol import kv_rows

if TYPE_CHECKING:  # the gateway reads configs without importing torch
    import torch

log = logging.getLogger(__name__)

# Architecture name in config.json -> what differs from plain Llama (the table of differences).
# qkv_bias None: read `attention_bias` from config (which biases o_proj too); qk_norm: per-head
# RMSNorm on q and k before RoPE. Phi-3's fused qkv_proj/gate_up_proj already are our layout, and
# its `partial_rotary_factor` and longrope scaling are read for every architecture. family
# `gemma` (models/gemma.py): scaled embedding, (1 + w) norms around both sublayers, GeLU-tanh,
# query_pre_attn_scalar, soft-capping where configured, local rope for sliding layers (Gemma 3).
# Sliding windows are per layer for every family (`layer_types`, Qwen2's max_window_layers).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"qkv_bias": None, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": None, "qk_norm": True},
    "Phi3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Gemma2ForCausalLM": {"qkv_bias": None, "qk_norm": False, "family": "gemma"},
    "Gemma3ForCausalLM": {"qkv_bias": None, "qk_norm": True, "family": "gemma"},
    # mixture of experts (models/moe.py): routed experts in place of the MLP
    "Qwen2MoeForCausalLM": {"qkv_bias": True, "qk_norm": False, "moe": "qwen2_moe"},
    "Qwen3MoeForCausalLM": {"qkv_bias": None, "qk_norm": True, "moe": "qwen3_moe"},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False, "moe": "mixtral"},
}
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # GeLU, tanh approximation
ROPE_KINDS = ("default", "linear", "llama3", "longrope")
MODEL_IMPLS = ("auto", "native", "transformers")  # --model-impl (vLLM's name)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # one of ROPE_KINDS
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # longrope: per-frequency divisors up to original_max_position (HF's `short_factor`; the long
    # ones are never used, see ModelConfig.max_context) and the scale on cos/sin.
    short_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"unsupported rope scaling type {self.kind!r}; supported: {', '.join(ROPE_KINDS)}")


@dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # transformers impl only: caps max_context (not served)
    # native: each layer's sliding window (0: full attention); () when no layer has one
    layer_windows: tuple[int, ...] = ()
    attn_softcap: float | None = None  # Gemma 2: scores -> tanh(s / cap) * cap
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' rope (None: `rope` for all)
    family: str = "llama"  # llama (models/llama.py) | gemma (models/gemma.py)
    norms_plus_one: bool = False  # Gemma from GGUF: norm weights stored as 1 + w (llama.cpp's converter)
    o_bias: bool = False  # o_proj bias (Llama, Qwen3: `attention_bias`)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    rotary_dim: int | None = None  # None: all of head_dim; else its first rotary_dim dims (Phi-4-mini)
    weights_tag: str = ""  # what else sets the weights' values (a GGUF file's tensor types), in the fingerprint
    impl: str = "native"  # native (models/llama.py) | transformers (models/transformers_backend.py)
    # Mixture of experts (models/moe.py; Qwen2-MoE, Qwen3-MoE, Mixtral). 0 experts: a dense model.
    num_experts: int = 0
    experts_per_token: int = 0  # top-k experts each token is routed to
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert, gated by sigmoid(x . w)
    dense_layers: tuple[int, ...] = ()  # an MoE model's layers with a dense MLP (mlp_only_layers, sparse step)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        rot = self.rotary_dims
        if not (0 < rot <= self.head_dim and rot % 2 == 0):
            raise ValueError(f"rotary dims {rot} (partial_rotary_factor) must be even and in (0, {self.head_dim}]")
        if self.rope.kind == "longrope" and len(self.rope.short_factor) != rot // 2:
            raise ValueError(f"longrope short_factor has {len(self.rope.short_factor)} entries, expected {rot // 2}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows needs one window >= 0 per layer ({self.num_layers}): {self.layer_windows}")
        if self.num_experts and not (
            0 < self.experts_per_token <= self.num_experts and self.expert_intermediate_size > 0
        ):
            raise ValueError(
                f"{self.num_experts} experts need 0 < experts per token ({self.experts_per_token}) <= experts"
                f" and an expert intermediate size ({self.expert_intermediate_size})"
            )

    def moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes tokens to experts (else its MLP is dense)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (a query at position p sees keys > p - window); None: full."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    @property
    def every_layer_windowed(self) -> bool:
        """Whether every layer has a sliding window (Mistral): then KV before the widest window is
        never read again."""
        return bool(self.layer_windows) and min(self.layer_windows) > 0

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each head RoPE rotates (the rest pass through)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def max_context(self) -> int:
        """Longest sequence this engine serves exactly. A sliding window caps it on the transformers
        path (the native one serves windows: `layer_windows`), and so does longrope's original_max_position_embeddings: past it HF recomputes a sequence's
        whole KV with `long_factor` frequencies, which KV shared between sequences and workers
        (prefix cache, P -> D transfer) cannot follow; below it HF uses `short_factor`, as we do."""
        limit = self.max_position_embeddings
        if self.sliding_window:
            limit = min(limit, self.sliding_window)
        if self.rope.kind == "longrope":
            limit = min(limit, self.rope.original_max_position)
        return limit

    @property
    def max_context_reason(self) -> str:
        """What sets max_context, for refusals that hit it."""
        if self.rope.kind == "longrope" and self.max_context == self.rope.original_max_position:
            return "longrope's original_max_position_embeddings (long_factor is not served)"
        if self.sliding_window and self.max_context == self.sliding_window:
            return "sliding_window (sliding-window attention is not served)"
        return "max_position_embeddings"

    @property
    def approx_params(self) -> int:
        """Parameters of the dense weights (attention, MLP, embedding and head; norms and biases
        left out): what `--dtype auto` weighs against the memory."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h = self.hidden_size
        attention = h * (2 * q + 2 * kv)
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = h * (3 * self.num_experts * self.expert_intermediate_size + self.num_experts)
        moe_mlp += h * (3 * self.shared_expert_intermediate_size + 1) if self.shared_expert_intermediate_size else 0
        mlps = sum(moe_mlp if self.moe_layer(i) else dense_mlp for i in range(self.num_layers))
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * attention + mlps + heads * self.vocab_size * h

    def fingerprint(self, dtype: "torch.dtype", kv_cache_dtype: str = "auto") -> str:
        """Pools exchanging KV must agree on this (and so do prefix-cache keys: it salts block
        hashes). `kv_cache_dtype` "int8" or "fp8" (--kv-cache-dtype) adds `/kv-int8` or `/kv-fp8`:
        such a pool's blocks hold other bytes and other values than the model dtype's."""
        return (
            f"{self.architecture}/L{self.num_layers}/H{self.num_heads}/KV{self.num_kv_heads}"
            f"/D{self.head_dim}/V{self.vocab_size}/{str(dtype).removeprefix('torch.')}"
            + (f"/{self.weights_tag}" if self.weights_tag else "")
            + ("/transformers" if self.impl == "transformers" else "")  # its KV rounds differently
            + (f"/SW{'-'.join(map(str, sorted(set(self.layer_windows))))}" if self.layer_windows else "")
            + kv_rows.fingerprint_tag(kv_cache_dtype)
        )

    @classmethod
    def from_folder(cls, path: str | Path, model_impl: str = "auto") -> "ModelConfig":
        """An HF folder's config.json, or a GGUF file's metadata (engine/gguf_file.py).
        `model_impl` (--model-impl): `native` refuses what models/llama.py cannot serve,
        `transformers` serves through transformers' modelling code, `auto` is native where the
        folder's architecture and features have a native path, else transformers."""
        from pdserve.engine.gguf_file import gguf_model_config, is_gguf

        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
        if is_gguf(path):
            if model_impl == "transformers":
                raise ValueError(f"{path}: a GGUF file is served by the native path only (--model-impl auto or native)")
            return gguf_model_config(path)
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} is neither a Hugging Face model folder (no config.json) nor a GGUF file")
        cfg = json.loads(cfg_file.read_text())
        from pdserve.engine.transformers_config import transformers_model_config

        if model_impl == "transformers":
            return transformers_model_config(path, cfg)
        try:
            return cls._native(path, cfg)
        except ValueError as why:
            if model_impl == "native":
                raise ValueError(f"--model-impl native: {why} (--model-impl auto or transformers serves it)") from None
            log.info("%s: no native path (%s); serving it through transformers' modelling code", path, why)
            return transformers_model_config(path, cfg)

    @classmethod
    def _native(cls, path: Path, cfg: dict[str, Any]) -> "ModelConfig":
        """The native model's config (models/llama.py); ValueError naming what it cannot serve."""
        cfg_file = path / "config.json"
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in "
                f"{cfg_file}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        traits = SUPPORTED_ARCHITECTURES[arch]
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        qkv_bias = traits["qkv_bias"]
        if qkv_bias and "qkv_bias" in cfg:  # Qwen2-MoE's config names it
            qkv_bias = bool(cfg["qkv_bias"])
        o_bias = False
        if qkv_bias is None:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        family = traits.get("family", "llama")
        act = (
            cfg.get("hidden_activation")
            or cfg.get("hidden_act")
            or ("gelu_pytorch_tanh" if family == "gemma" else "silu")
        )
        if act not in (GEMMA_ACTIVATIONS if family == "gemma" else ("silu",)):
            raise ValueError(f"hidden activation {act!r} is not supported for {arch}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True (not a causal LM) is not supported")
        rope, local_rope = _rope_from_hf(cfg), None
        if family == "gemma":
            rope, local_rope = _gemma_ropes(cfg, arch)
        partial = float(_rope_params(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if rope.kind == "longrope":
            log.warning(
                "%s: longrope served up to original_max_position_embeddings=%d only (short_factor); "
                "longer sequences (long_factor) are refused",
                path,
                rope.original_max_position,
            )
        return cls(
            path=str(path),
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            eos_token_ids=eos_token_ids(path, cfg),
            layer_windows=_layer_windows(cfg, arch),
            attn_softcap=cfg.get("attn_logit_softcapping") if family == "gemma" else None,
            final_softcap=cfg.get("final_logit_softcapping") if family == "gemma" else None,
            attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5 if family == "gemma" else None,
            local_rope=local_rope,
            family=family,
            o_bias=o_bias,
            qk_norm=traits["qk_norm"],
            rotary_dim=None if partial == 1.0 else int(head_dim * partial),  # HF: int(head_dim * factor)
            **(_moe_fields(cfg, traits["moe"]) if "moe" in traits else {}),
        )


def _moe_fields(cfg: dict[str, Any], kind: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from an HF config (`kind`: the table's `moe`).
    Qwen2/3-MoE: `num_experts`, `moe_intermediate_size`, `norm_topk_prob`, dense layers from
    `mlp_only_layers` and `decoder_sparse_step`; Qwen2-MoE's shared expert; Mixtral: every layer
    sparse, `num_local_experts` of `intermediate_size`, top-k weights always renormalised
    (transformers 5 writes every one's count as `num_local_experts`)."""
    n, experts = cfg["num_hidden_layers"], cfg.get("num_experts") or cfg.get("num_local_experts")
    if kind == "mixtral":
        return dict(
            num_experts=experts,
            experts_per_token=cfg["num_experts_per_tok"],
            expert_intermediate_size=cfg["intermediate_size"],
            norm_topk_prob=True,
        )
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    return dict(
        num_experts=experts,
        experts_per_token=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", kind == "qwen3_moe")),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if kind == "qwen2_moe"
        else 0,
        dense_layers=tuple(i for i in range(n) if i in dense or (i + 1) % step),
    )


def _layer_windows(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """Each layer's sliding window as HF builds it (0: full attention); () when none has one.
    `layer_types` where the config lists them (Gemma 2/3, Qwen2/3 in transformers 5), else
    Gemma's pattern (every `sliding_window_pattern`-th layer full: 2 for Gemma 2, default 6 for
    Gemma 3), else Qwen2's rule (windowed from layer max_window_layers on, when
    use_sliding_window), else Mistral's (every layer, when sliding_window is set)."""
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if not window or not cfg.get("use_sliding_window", True):
        return ()
    types = cfg.get("layer_types")
    if types is not None:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown or len(types) != n:
            raise ValueError(f"layer_types {sorted(set(types))} (need {n} of sliding/full_attention)")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        default = 2 if arch == "Gemma2ForCausalLM" else 6
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default)
        windows = tuple(window if (i + 1) % pattern else 0 for i in range(n))
    elif "max_window_layers" in cfg:
        windows = tuple(window if i >= cfg["max_window_layers"] else 0 for i in range(n))
    else:
        windows = (window,) * n
    return windows if any(windows) else ()


def _gemma_ropes(cfg: dict[str, Any], arch: str) -> tuple[RopeConfig, RopeConfig | None]:
    """(full layers' rope, sliding layers' rope or None): Gemma 3 keeps one per layer type
    (transformers 5: rope_parameters[type]; 4.x: rope_theta/rope_scaling and rope_local_base_freq)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        glob = _rope_from_hf({"rope_parameters": params["full_attention"]})
        local = _rope_from_hf({"rope_parameters": params.get("sliding_attention") or {"rope_theta": 10000.0}})
        return glob, local
    if arch == "Gemma3ForCausalLM":
        return _rope_from_hf(cfg), RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    return _rope_from_hf(cfg), None


def _rope_params(cfg: dict) -> dict:
    # transformers 5 folds theta + scaling into `rope_parameters`; 4.x uses rope_theta/rope_scaling.
    return {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


def _rope_from_hf(cfg: dict) -> RopeConfig:
    params = _rope_params(cfg)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind in ("su", "yarn") and "short_factor" in params:  # Phi-3's old names for longrope (HF renames)
        kind = "longrope"
    if kind != "longrope":
        return RopeConfig(
            theta=float(theta),
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )
    # As transformers' _compute_longrope_parameters: factor defaults to max / original positions,
    # and the attention factor (scaling cos and sin) to sqrt(1 + ln(factor) / ln(original)).
    original = int(
        params.get("original_max_position_embeddings")
        or cfg.get("original_max_position_embeddings")
        or cfg.get("max_position_embeddings", 2048)
    )
    factor = params.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(factor),
        original_max_position=original,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        attention_factor=float(attention_factor),
    )


def eos_token_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    gen_file = path / "generation_config.json"
    sources = [cfg]
    if gen_file.is_file():
        sources.insert(0, json.loads(gen_file.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        for e in eos if isinstance(eos, list) else [eos]:
            if e is not None and e not in ids:
                ids.append(int(e))
    return tuple(ids)


FP32_MEMORY_SHARE = 0.5  # `auto` keeps fp32 weights on the CPU while they take at most this share of the memory


def resolve_dtype(
    name: str, device: "torch.device", quantized_weights: bool = False, params: int | None = None
) -> "torch.dtype":
    """`auto`: bf16 on CUDA. On the CPU fp32, unless its weights (`params` of them) would take over
    FP32_MEMORY_SHARE of the machine's memory on a CPU with bf16 matrix units (AVX512-BF16/AMX): then
    bf16, half the bytes. fp32 is the faster CPU dtype here: the one-call decode driver and the
    quantized kernels take fp32 (bf16 decode steps ran at 0.78-0.89x the fp32 rate on the
    real-shape model with the bf16 panel copy, 0.36-0.83x without it: docs/benchmarks/engine.md),
    and it is exact against transformers in fp32. Linears kept quantized (`quantized_weights`)
    always get fp32 activations.
    The machine's memory, not what is free now: workers of one host (P and D) decide alike."""
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name != "auto":
        if name not in table:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(table)}")
        return table[name]
    if device.type == "cuda":
        return torch.bfloat16
    if quantized_weights or not cpu_has_fast_bf16():
        return torch.float32
    return torch.float32 if fp32_fits(params) else torch.bfloat16


def auto_dtype_reason(dtype: "torch.dtype", device: "torch.device", quantized_weights: bool) -> str:
    """Why `auto` resolved to `dtype` (for the log)."""
    import torch

    if device.type == "cuda":
        return "CUDA"
    if dtype != torch.float32:
        return f"fp32 weights would take over {FP32_MEMORY_SHARE:.0%} of the machine's memory"
    if quantized_weights:
        return "linears kept quantized: their kernels take fp32 activations"
    return "the CPU's fastest dtype here; bf16 only where fp32 weights would not fit"


def fp32_fits(params: int | None) -> bool:
    """Whether `params` fp32 weights take at most FP32_MEMORY_SHARE of this machine's memory
    (unknown count or memory: assumed to fit)."""
    memory = machine_memory_bytes()
    return params is None or memory is None or 4 * params <= FP32_MEMORY_SHARE * memory


def machine_memory_bytes() -> int | None:
    """MemTotal, or the cgroup's memory limit where lower (a container); None where unknown."""
    sizes: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                sizes.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            sizes.append(int(limit))
    except OSError:
        pass
    return min(sizes) if sizes else None


def keeps_weights_quantized(cfg: ModelConfig) -> bool:
    """Whether `quantized` tagged this config: linears kept int8/int4 (a GGUF file's blocks or
    --quantization int8/int4)."""
    return any(t in ("auto", "int8", "int4") for t in cfg.weights_tag.split("+"))


def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


KvCacheDtype = Literal["auto", "int8", "fp8"]  # --kv-cache-dtype (vLLM's name; fp8: e4m3, vLLM's too)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)


@dataclass(frozen=True)
class CacheConfig:
    block_size: Annotated[int, Flag("tokens per KV block (a power of two)")] = 16
    num_blocks: Annotated[int | None, Flag("KV blocks (overrides --kv-cache-memory)")] = None
    memory_bytes: Annotated[
        int, Flag("KV cache budget, e.g. 512MiB (default 1GiB)", name="--kv-cache-memory", parse=parse_size)
    ] = 1 << 30
    enable_prefix_caching: Annotated[
        bool,
        Flag(
            "keep the KV of full prompt blocks after their request ends and reuse it for any "
            "request with the same prefix (--no-enable-prefix-caching: compute every prompt)"
        ),
    ] = True  # engine/prefix_cache.py
    kv_cache_dtype: Annotated[
        KvCacheDtype,
        Flag(
            "what the paged KV cache stores: auto, the model's dtype; int8, each token's K and V per head as "
            "int8 with an fp32 scale; fp8, the same as float8 e4m3 values (both about a quarter of fp32's bytes, "
            "in memory and on the KV wire). Prefill and decode workers exchanging KV must agree"
        ),
    ] = "auto"
    kv_offload_dir: Annotated[
        str | None,
        Flag(
            "a folder for the prefix cache's disk tier: full blocks' KV written there (off the step loop, "
            "checksummed) and read back instead of recomputing a prefix that left RAM or was computed before "
            "a restart; workers of one host may share it (engine/kv_disk_tier.py)"
        ),
    ] = None
    kv_offload_bytes: Annotated[
        int,
        Flag(
            "the disk tier's size, e.g. 20GiB (least recently used blocks go)",
            name="--kv-offload-size",
            parse=parse_size,
        ),
    ] = 20 << 30

    def __post_init__(self) -> None:
        if self.kv_offload_bytes <= 0:
            raise ValueError(f"--kv-offload-size must be > 0, got {self.kv_offload_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")


SCHEDULING_POLICIES = ("fcfs", "shortest-first")
# --quantization; auto: a GGUF file's quantized linears kept as stored (engine/quantize.py
# KEPT_GGUF_TYPES), float weights as they are
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# --activation-quantization: int8, a quantized linear's few-row calls quantize their input rows;
# auto: int8 for a GGUF file's kept blocks (as llama.cpp runs the same file), else none
ACTIVATION_QUANTIZATIONS = ("auto", "none", "int8")
# --prompt-linears: how the linears on a GGUF file's blocks (int8 activations, one rank) multiply a
# prompt's rows: bf16 (kernels/block_gemm.py linear_bf16) or int8 as decode rows; auto: bf16 where
# the CPU multiplies bf16 itself (AVX-512 BF16)
PROMPT_LINEARS = ("auto", "int8", "bf16")


def resolve_activations(activations: str, quantization: str, model: str) -> str:
    """--activation-quantization as applied: "int8" or "none"."""
    from pdserve.engine.gguf_file import is_gguf

    if activations != "auto":
        return activations
    return "int8" if quantization == "auto" and is_gguf(model) else "none"


def resolve_prompt_linears(choice: str, activations: str, blocks_as_stored: bool) -> str:
    """--prompt-linears as applied: "bf16" or "int8" ("int8" too where no block kernel runs)."""
    if activations != "int8" or not blocks_as_stored:
        return "int8"
    if choice != "auto":
        return choice
    from pdserve.kernels import block_gemm

    return "bf16" if block_gemm.bf16_native() else "int8"


DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype


BLOCK_KERNEL_TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")  # read as stored by kernels/block_gemm.py


def quantized(
    cfg: ModelConfig,
    quantization: str,
    activations: str = "none",
    blocks_as_stored: bool = False,
    prompt_linears: str = "int8",
) -> ModelConfig:
    """`cfg` with a weight-only quantization (and int8 activations) named in its fingerprint (they
    change the KV). `blocks_as_stored`: a GGUF file's K-quant / Q8_0 tensors would run on the file's
    blocks (one rank: x quantized per 256, `+int8x-blocks`), not on a group-wise copy (tensor
    parallelism: per 32, `+int8x`): the two round differently, so their pools must not pair.
    `prompt_linears` bf16 (resolved): those blocks multiply prompts' rows in bf16 (`+bf16-prompts`)."""
    from pdserve.engine.gguf_file import is_gguf

    if quantization == "none" or (quantization == "auto" and not is_gguf(cfg.path)):
        return cfg
    int8 = ""
    if activations == "int8":
        kept = {"int8": ["Q8_0"], "int4": ["Q4_0"]}.get(quantization, cfg.weights_tag.removeprefix("gguf-").split("+"))
        as_stored = blocks_as_stored and any(t in BLOCK_KERNEL_TYPES for t in kept)
        int8 = "int8x-blocks" if as_stored else "int8x"
        if as_stored and prompt_linears == "bf16":
            int8 += "+bf16-prompts"
    tags = (cfg.weights_tag, quantization, int8)
    return replace(cfg, weights_tag="+".join(t for t in tags if t))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: Annotated[int, Flag("most sequences running at once (a step's batch)")] = 64
    # per-step token budget (decode tokens + prefill chunks)
    max_num_batched_tokens: Annotated[
        int,
        Flag(
            "token budget of a step (default: 512 for a prefill or colocated worker on CPU, else 2048; cli/topology.py)",
            planned=True,
        ),
    ] = 2048
    max_model_len: Annotated[
        int | None, Flag("longest sequence, prompt + output (default: the model's max context)")
    ] = None
    # Which waiting prompt starts next: arrival order, or the fewest tokens left to prefill, where
    # each second of waiting counts as `aging_tokens_per_s` fewer tokens (nothing starves).
    policy: Annotated[
        str,
        Flag(
            "which waiting prompt is prefilled next: arrival order, or the shortest (aged by its wait, so none "
            "starves): more requests within a TTFT SLO under load",
            name="--scheduling-policy",
            choices=SCHEDULING_POLICIES,
        ),
    ] = "fcfs"
    aging_tokens_per_s: float = 1000.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not self.aging_tokens_per_s >= 0:
            raise ValueError("aging_tokens_per_s must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    model: Annotated[str, Flag("HF model folder or GGUF file (default: the embedded random Llama)")]
    dtype: Annotated[
        str, Flag("auto: bf16 on CUDA; fp32 on the CPU (bf16 if fp32 weights exceed half the memory)", choices=DTYPES)
    ] = "auto"
    device: Annotated[str, Flag("a torch device: cpu, cuda, cuda:N")] = "cpu"
    enforce_eager: Annotated[
        bool,
        Flag(
            "CUDA: run every step eagerly (default: decode steps replay CUDA graphs captured per "
            "batch and context bucket on first use, engine/cuda_graphs.py)"
        ),
    ] = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: Annotated[int | None, Flag("sampler seed for requests without their own")] = None
    # weight-only linears (engine/models/quantized_linear.py)
    quantization: Annotated[
        str,
        Flag(
            "weight-only quantized linear layers (CPU). auto (default): a GGUF file's Q8_0, Q4_0, Q4_1, "
            "Q4_K, Q5_K and Q6_K linears are kept as stored (other types dequantized), float weights stay "
            "float; int8 / int4: every linear quantized at load in groups of 32 inputs with a scale each "
            "(a GGUF file's Q8_0 / Q4_0 blocks kept); none: everything dequantized to --dtype",
            choices=QUANTIZATIONS,
        ),
    ] = "auto"
    activation_quantization: Annotated[
        str,
        Flag(
            "int8: the quantized linears' decode-size calls (up to 48-64 rows) quantize their input rows "
            "to int8 per group of 32 and multiply in integers, as llama.cpp does (2-3x faster decode "
            "linears on the CPU; logits agree with fp32 activations to ~1e-3, not bit for bit); none: fp32 "
            "(bit for bit HF on the dequantized weights); auto (default): int8 for a GGUF file's kept "
            "blocks, none otherwise",
            choices=ACTIVATION_QUANTIZATIONS,
        ),
    ] = "auto"
    prompt_linears: Annotated[
        str,
        Flag(
            "how the linears on a GGUF file's K-quant / Q8_0 blocks multiply a prompt's rows (int8 "
            "activations, one rank): bf16: x and the widened weight rounded to bf16, multiplied by "
            "AVX-512 BF16's vdpbf16ps (~2.2x the int8 products a core; agreement with fp32 as int8's or "
            "better); int8: as decode rows; auto (default): bf16 where the CPU has AVX-512 BF16",
            choices=PROMPT_LINEARS,
        ),
    ] = "auto"
    model_impl: Annotated[  # ModelConfig.from_folder
        str,
        Flag(
            "native: pdserve's own model code (Llama, Mistral, Qwen2, Qwen3, Phi-3); transformers: "
            "transformers' modelling code with pdserve's paged KV cache (any decoder-only model, slower); "
            "auto (default): native where the folder has a native path, else transformers",
            choices=MODEL_IMPLS,
        ),
    ] = "auto"
    speculative: Annotated[  # None: off
        SpeculativeConfig | None,
        Flag(
            'decode-side speculation (vLLM\'s JSON): \'{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\', or a draft model of the same tokenizer: '
            '\'{"model": DIR, "num_speculative_tokens": 4}\', or an EAGLE-1 head: \'{"method": "eagle", '
            '"model": DIR, "num_speculative_tokens": 4}\' (+ "disable_by_batch_size": no speculation in '
            "steps with more decoding sequences); decode and colocated workers (engine/spec/); prefill "
            "workers given a draft model compute its KV and ship it with the target's",
            name="--speculative-config",
            parse=SpeculativeConfig.from_json,
        ),
    ] = None
    # ranks of one logical engine (engine/parallel/): this process is rank 0 and starts the others
    tensor_parallel_size: Annotated[
        int,
        Flag(
            "split the model over N processes on this machine (Megatron-style, gloo on the CPU): this worker's "
            "threads are shared out, threads/N per rank; `serve`: every pool's degree "
            "(--prefill-/--decode-tensor-parallel-size set one pool's)"
        ),
    ] = 1
    tensor_parallel_timeout_s: float = 60.0  # a collective waiting longer than this raises

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.activation_quantization not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(
                f"activation_quantization must be one of {ACTIVATION_QUANTIZATIONS}, got {self.activation_quantization!r}"
            )
        if self.activation_quantization == "int8" and self.quantization == "none":
            raise ValueError(
                "--activation-quantization int8 applies to quantized weights: not with --quantization none"
            )
        if self.prompt_linears not in PROMPT_LINEARS:
            raise ValueError(f"prompt_linears must be one of {PROMPT_LINEARS}, got {self.prompt_linears!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.tensor_parallel_size < 1 or not self.tensor_parallel_timeout_s > 0:
            raise ValueError("tensor_parallel_size must be >= 1 and tensor_parallel_timeout_s > 0")
        if self.tensor_parallel_size > 1:
            from pdserve.engine.gguf_file import is_gguf

            if self.quantization in ("int8", "int4"):
                raise ValueError("--tensor-parallel-size > 1 with --quantization is not supported yet")
            if self.quantization == "auto" and is_gguf(self.model):
                raise ValueError(
                    "--tensor-parallel-size > 1 does not shard a GGUF file's quantized blocks yet: "
                    "add --quantization none to serve it dequantized"
                )
            if self.model_impl == "transformers":
                raise ValueError(
                    "--tensor-parallel-size > 1 runs the native model path only, not --model-impl transformers"
                )
            if self.device != "cpu":
                raise ValueError("--tensor-parallel-size > 1 is built for the CPU (gloo) only so far")
