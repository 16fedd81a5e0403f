"""Engine flags shared by every worker role, and their typed config."""

from __future__ import annotations

import argparse

from pdserve.cli.topology import step_budget
from pdserve.engine.config import MODEL_IMPLS, QUANTIZATIONS, CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.spec.config import SpeculativeConfig


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1G', '100000' -> bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model folder or GGUF file (default: the embedded random Llama)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="weight-only quantized linear layers (CPU). auto (default): a GGUF file's Q8_0, Q4_0, Q4_1, "
        "Q4_K, Q5_K and Q6_K linears are kept as stored (other types dequantized), float weights stay "
        "float; int8 / int4: every linear quantized at load in groups of 32 inputs with a scale each "
        "(a GGUF file's Q8_0 / Q4_0 blocks kept); none: everything dequantized to --dtype",
    )
    g.add_argument(
        "--model-impl",
        default="auto",
        choices=MODEL_IMPLS,
        help="native: pdserve's own model code (Llama, Mistral, Qwen2, Qwen3, Phi-3); transformers: "
        "transformers' modelling code with pdserve's paged KV cache (any decoder-only model, slower); "
        "auto (default): native where the folder has a native path, else transformers",
    )
    g.add_argument("--device", default="cpu")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=parse_size("1GiB"),
        help="KV cache budget, e.g. 512MiB (default 1GiB)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the KV of full prompt blocks after their request ends and reuse it for any "
        "request with the same prefix (--no-enable-prefix-caching: compute every prompt)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of a step (default: 512 for a prefill or colocated worker on CPU, "
        "else 2048; cli/topology.py)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "shortest-first"],
        help="which waiting prompt is prefilled next: arrival order, or the shortest "
        "(aged by its wait, so none starves): more requests within a TTFT SLO under load",
    )
    g.add_argument("--threads", type=int, default=None, help="torch threads for this worker")
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over N processes on this machine (Megatron-style, gloo on the CPU): "
        "this worker's threads are shared out, threads/N per rank; `serve`: every pool's degree "
        "(--prefill-/--decode-tensor-parallel-size set one pool's)",
    )
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        help='decode-side speculation (vLLM\'s JSON): \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\', or a draft model of the same tokenizer: '
        '\'{"model": DIR, "num_speculative_tokens": 4}\', or an EAGLE-1 head: \'{"method": "eagle", '
        '"model": DIR, "num_speculative_tokens": 4}\' (+ "disable_by_batch_size": no speculation in '
        "steps with more decoding sequences); decode and colocated workers (engine/spec/); prefill "
        "workers given a draft model compute its KV and ship it with the target's",
    )


def resolve_model(model: str | None) -> str:
    if model:
        return model
    from pdserve.engine.make_model import default_model_path

    return str(default_model_path())


def refuse_tensor_parallel(args: argparse.Namespace, role: str) -> None:
    """--tensor-parallel-size > 1 where it is not built, or with a model it cannot split: a clear
    exit at start, rather than a worker that fails and is restarted forever."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.parallel.shard import check_tensor_parallel

    n = args.tensor_parallel_size
    if role == "prefill" and (getattr(args, "lanes", 1) > 1 or (getattr(args, "idle_lanes", None) or 0) > 0):
        raise SystemExit(
            "pdserve prefill: --tensor-parallel-size > 1 runs one lane (its ranks step in lockstep): "
            "drop --lanes / --idle-lanes"
        )
    try:
        EngineConfig(
            model="",
            quantization=args.quantization,
            model_impl=args.model_impl,
            device=args.device,
            tensor_parallel_size=n,
        )
        check_tensor_parallel(ModelConfig.from_folder(resolve_model(args.model), args.model_impl), n)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"pdserve {role}: {e}") from None


def refuse_unfit_draft(args: argparse.Namespace, role: str, draft: str) -> None:
    """A draft model that does not speak the target's tokens: a clear exit at start."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.spec.draft_fit import check_draft_fits

    try:
        check_draft_fits(
            ModelConfig.from_folder(resolve_model(args.model), args.model_impl), ModelConfig.from_folder(draft)
        )
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"pdserve {role}: --speculative-config: {e}") from None


def engine_config(args: argparse.Namespace, role: str, budget: int | None = None) -> EngineConfig:
    """The engine flags as a `role` worker's config (its step budget planned by cli/topology.py;
    `budget` given wins)."""
    if args.tensor_parallel_size != 1:
        refuse_tensor_parallel(args, role)
    spec: SpeculativeConfig | None = getattr(args, "speculative_config", None)
    if role == "prefill" and spec is not None and spec.model is None:
        spec = None  # n-gram: nothing to do on the prefill side (a draft model's KV is built there)
    if spec is not None and spec.model is not None:
        refuse_unfit_draft(args, role, spec.model)
    return EngineConfig(
        model=resolve_model(args.model),
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        model_impl=args.model_impl,
        seed=args.seed,
        speculative=spec,
        tensor_parallel_size=args.tensor_parallel_size,
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            memory_bytes=args.kv_cache_memory,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=step_budget(role, args.device, budget or args.max_num_batched_tokens),
            max_model_len=args.max_model_len,
            policy=args.scheduling_policy,
        ),
    )
