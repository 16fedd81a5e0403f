"""`python -m pdserve.bench.speculation`: decode tokens/s with and without n-gram speculation,
one engine (speculation switched on and off between runs, so weights and KV are the same),
at several batch sizes, on two workloads:

    repetitive  greedy: a random-weight model's greedy output falls into loops, which the
                prompt lookup predicts (the copy/edit case: output largely seen before)
    sampled     `--temperature` (20: near uniform), seeded: output rarely repeats, lookups
                rarely match and drafts mostly miss (the cost of proposing and verifying where
                it does not pay, and what adaptivity saves)

`--draft-model DIR` (or `--cut-draft N`: a draft made of the target's first N layers, its
embedding, final norm and head) speculates with that draft model instead of n-gram lookup; the
model given as its own draft is the upper bound of acceptance. `--eagle DIR` speculates with an
EAGLE-1 head (engine/spec/eagle.py; `pdserve make-model --eagle-for MODEL --out DIR` writes a
random one, whose drafts nearly all miss: the cost side, and what adaptivity saves).

Each row: prompts prefilled first (untimed), then the decode of `--max-tokens` tokens per
sequence timed; best of `--repeats` interleaved runs. Greedy rows also check that both runs
emit the same tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.draft_model import DraftRunner
from pdserve.engine.spec.eagle import EagleRunner
from pdserve.engine.spec.speculator import Speculator
from pdserve.protocol.sampling import SamplingParams


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def timed_decode(
    engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, list[list[int]]]:
    """Seconds (of `clock`) to decode every prompt's output once all are prefilled, and the outputs."""
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        rid = f"b{time.monotonic_ns()}-{i}"
        engine.add_request(rid, p, sp)
        outs[rid] = []

    def collect(step_outputs) -> None:
        for o in step_outputs:
            outs[o.request_id].extend(o.new_token_ids)

    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        collect(engine.step())  # prefill (untimed)
    t0 = clock()
    while engine.has_work():
        collect(engine.step())
    return clock() - t0, list(outs.values())


def cut_layers(model: str, out: Path, num_layers: int) -> Path:
    """A draft folder holding `model`'s first `num_layers` decoder layers (and its embedding,
    final norm and head): same tokenizer, same first layers."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in out.glob("*.safetensors"):
        kept = {}
        for name, t in load_file(f).items():
            m = re.search(r"\.layers\.(\d+)\.", name)
            if m is None or int(m.group(1)) < num_layers:
                kept[name] = t
        save_file(kept, f, metadata={"format": "pt"})
    for index in out.glob("*.safetensors.index.json"):
        index.unlink()  # (the bench models are single-file; a sharded index would name dropped tensors)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    spec = SpeculativeConfig(
        method="eagle" if args.eagle else "draft_model" if args.draft_model else "ngram",
        model=args.eagle or args.draft_model,
        num_speculative_tokens=args.k,
        prompt_lookup_max=4,
        prompt_lookup_min=1,
        disable_by_batch_size=args.disable_by_batch_size,
    )
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="float32",
            cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024),
        ),
        show_progress=False,
    )
    draft: DraftRunner | EagleRunner | None = None
    if args.eagle:
        target = engine.runner.model
        assert isinstance(target, LlamaForCausalLM)
        draft = EagleRunner(
            args.eagle, target, engine.dtype, engine.device, engine.max_model_len, engine.block_size, args.num_blocks
        )
    elif args.draft_model:
        draft = DraftRunner(
            engine.model_config.__class__.from_folder(args.draft_model),
            engine.dtype,
            engine.device,
            engine.max_model_len,
            engine.pool,  # its KV in the engine's blocks (same ids)
            engine.block_size,
            show_progress=False,
        )
    vocab = engine.model_config.vocab_size
    rows = []
    for workload in args.workloads:
        greedy = workload == "repetitive"
        for batch in args.batches:
            prompts = _prompts(batch, args.prompt_len, vocab, seed=batch)
            times: dict[str, float] = {"off": float("inf"), "on": float("inf")}
            outputs: dict[str, list[list[int]]] = {}
            stats = None
            for r in range(args.repeats + 1):  # the first round warms up, untimed
                for mode in ("off", "on"):
                    engine.speculator = Speculator(spec, engine.max_model_len, draft) if mode == "on" else None
                    sp = SamplingParams(
                        max_tokens=args.max_tokens,
                        temperature=0.0 if greedy else args.temperature,
                        seed=None if greedy else 7,
                        ignore_eos=True,
                    )
                    dt, outs = timed_decode(
                        engine, prompts, sp, time.process_time if args.cpu_time else time.perf_counter
                    )
                    if r:
                        times[mode] = min(times[mode], dt)
                    outputs[mode] = outs
                    if mode == "on" and engine.speculator is not None:
                        stats = engine.speculator.stats
            engine.pool.assert_all_free()
            if draft is not None:
                draft.pool.assert_all_free()
            tokens = batch * args.max_tokens
            assert stats is not None
            row = {
                "draft": args.draft_label,
                "workload": workload,
                "batch": batch,
                "tok_s_off": round(tokens / times["off"], 1),
                "tok_s_on": round(tokens / times["on"], 1),
                "speedup": round(times["off"] / times["on"], 2),
                "acceptance": round(stats.num_accepted_tokens / max(1, stats.num_draft_tokens), 2),
                "drafts_per_token": round(stats.num_draft_tokens / tokens, 2),  # (the last run's)
                "same_output": outputs["on"] == outputs["off"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from pdserve.modelgen.make_model import default_model_path

    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.speculation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the bench model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "sampled"], choices=["repetitive", "sampled"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--disable-by-batch-size", type=int, default=SpeculativeConfig().disable_by_batch_size)
    ap.add_argument("--temperature", type=float, default=20.0, help="of the sampled workload")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU seconds, not wall time (with --threads 1: steadier on a shared host)",
    )
    drafts = ap.add_mutually_exclusive_group()
    drafts.add_argument("--draft-model", default=None, help="speculate with this draft model (not n-gram)")
    drafts.add_argument("--cut-draft", type=int, default=None, help="draft: the model's first N layers")
    drafts.add_argument("--eagle", default=None, metavar="DIR", help="speculate with this EAGLE-1 head")
    args = ap.parse_args(argv)
    args.model = args.model or str(default_model_path())
    args.draft_label = f"eagle {Path(args.eagle).name}" if args.eagle else "ngram"
    if args.draft_model:
        args.draft_label = (
            "itself" if Path(args.draft_model).resolve() == Path(args.model).resolve() else args.draft_model
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    from pdserve.bench.machine import measure_read_gbps

    before = measure_read_gbps()  # the machine's read ceiling, before and after (a shared host drifts)
    with tempfile.TemporaryDirectory(prefix="pdserve-cut-draft-") as tmp:
        if args.cut_draft is not None:
            args.draft_model = str(cut_layers(args.model, Path(tmp) / "draft", args.cut_draft))
            args.draft_label = f"first {args.cut_draft} layers"
        run(args)
    print(json.dumps({"read_gbps_before": round(before, 1), "read_gbps_after": round(measure_read_gbps(), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
