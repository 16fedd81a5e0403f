"""Engine flags shared by every worker role (made from EngineConfig's fields), and their typed config."""

from __future__ import annotations

import argparse

from pdserve.cli.settings_flags import add_flags, from_flags
from pdserve.cli.topology import step_budget
from pdserve.engine.config import EngineConfig
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.modelgen.default_model import resolve_model


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig, "engine")


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
    planned = {
        "model": resolve_model(args.model),
        "speculative": spec,
        "scheduler.max_num_batched_tokens": step_budget(role, args.device, budget or args.max_num_batched_tokens),
    }
    return from_flags(EngineConfig, args, planned)
