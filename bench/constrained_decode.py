"""What constrained decoding costs a decode batch: TPOT of a batch of 32 with half the requests
under a JSON-schema constraint vs none constrained, the same load, rounds interleaved.

    python -m pdserve.bench.constrained_decode [--model DIR] [--batch 32] [--steps 48]

Every request decodes the whole measured stretch (unconstrained ones ignore EOS; the
constrained ones follow a schema that cannot end within it: an array of at least 400 integers),
so both batches keep all their rows. A step's time includes filling the constrained rows'
bitmasks and applying them (engine/structured/). Goal: <= 10% slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 400}},
    "required": ["values"],
    "additionalProperties": False,
}


def _decode_step_s(engine: LLMEngine, batch: int, constrained: int, prompt_len: int, steps: int, tag: str) -> float:
    """Median seconds per decode step of `batch` sequences, `constrained` of them under SCHEMA."""
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(3, engine.model_config.vocab_size, (batch, prompt_len), generator=g).tolist()
    so = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA))
    for i, p in enumerate(prompts):
        sp = SamplingParams(
            max_tokens=steps + 4,
            temperature=0.0,
            ignore_eos=i >= constrained,
            structured=so if i < constrained else None,
        )
        engine.add_request(f"{tag}-{i}", p, sp)
    while any(s.num_uncomputed > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prompts
    engine.step()  # first decode step (warm)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    assert len(engine.scheduler.running) == batch, "a sequence ended inside the measured stretch"
    while engine.has_work():
        engine.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded ~30M model)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pdserve.modelgen.default_model import resolve_model

    need = args.batch * (args.prompt_len + args.steps + 32) // 16 + 64
    engine = LLMEngine(
        EngineConfig(
            model=resolve_model(args.model),
            dtype="float32",
            cache=CacheConfig(num_blocks=need, enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=args.batch,
                max_num_batched_tokens=max(2048, args.batch),
                max_model_len=args.prompt_len + args.steps + 64,
            ),
        ),
        show_progress=False,
    )
    half = args.batch // 2
    plain, mixed = [], []
    for r in range(args.rounds):  # interleaved, so both see the machine's state of the moment
        plain.append(_decode_step_s(engine, args.batch, 0, args.prompt_len, args.steps, f"plain{r}"))
        mixed.append(_decode_step_s(engine, args.batch, half, args.prompt_len, args.steps, f"mixed{r}"))
    p, m = min(plain), min(mixed)
    print(f"model {engine.model_config.path}, batch {args.batch}, {torch.get_num_threads()} threads")
    print(f"{'batch':<32} {'TPOT ms (best round)':>20} {'rounds':>24}")
    print(f"{'none constrained':<32} {p * 1e3:>20.2f} {', '.join(f'{x * 1e3:.2f}' for x in plain):>24}")
    print(
        f"{f'{half} of {args.batch} constrained':<32} {m * 1e3:>20.2f} {', '.join(f'{x * 1e3:.2f}' for x in mixed):>24}"
    )
    print(f"constrained / none: {m / p:.3f} (goal <= 1.10)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
