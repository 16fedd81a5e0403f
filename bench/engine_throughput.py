"""`pdserve bench-engine`: prefill and decode tokens/s of the engine at batch 1, 8, 32, each
beside the machine's matmul FLOP/s and read GB/s measured in the same run.

    prefill MFU      = 2 * decoder-layer params * tokens / time / matmul FLOP/s
    MFU+attn         = (the same + causal attention FLOPs) / time / matmul FLOP/s, attention
                       counted as 2 * 2 * L (L + 1) / 2 * head_dim * heads * layers a prompt of L
                       (Q K^T and P V; the "attn" column is its share of the prompt's FLOPs)
    decode bandwidth = (weight bytes + KV bytes read) per step / step time / read GB/s (on the CPU
    a sum over 256 MB, the ceiling of a read-only stream; memcpy GB/s, which counts each byte
    once though a copy moves it twice, is printed beside it)

On the CPU each ceiling is measured before and after the rows and the higher taken, and each
row's figures are the best of --repeats runs: on a shared host the read rate alone was seen
anywhere from 27 to 54 GB/s within minutes.

The process is configured as a serving worker's (pdserve/worker_process.py): glibc keeps large blocks in its
heap (kvtransfer/malloc_tuning.py), so a step's multi-MB activations reuse warm pages (1-2% of
a 512-token prefill step here); --glibc-malloc-defaults measures without that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from unittest import mock

import torch

from pdserve.bench.machine import measure_matmul_gflops, measure_memcpy_gbps, measure_read_gbps
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker_process import configure_worker_process


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def bench_prefill(engine: LLMEngine, batch: int, prompt_len: int) -> float:
    """Seconds to prefill `batch` prompts, in steps of the engine's token budget."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, prompt_len, engine.model_config.vocab_size, batch)):
        engine.add_request(f"p{batch}-{i}", p, sp)
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0


def bench_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Seconds per decode step with `batch` running sequences at ~`context` tokens."""
    sp = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, context, engine.model_config.vocab_size, 100 + batch)):
        engine.add_request(f"d{batch}-{i}", p, sp)
    engine.step()  # prefill all (budget permitting)
    while any(s.num_uncomputed > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # warm decode
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    while engine.has_work():
        engine.step()
    return dt


def tiled_prefill_attention() -> contextlib.AbstractContextManager:
    """The engine's CPU prefill chunks on the older tiled C kernel alone while open (the figures
    before kernels/cpu_prefill_flash.c, for a same-run comparison)."""
    from pdserve.kernels import attention, cpu_native

    return mock.patch.object(attention, "CPU_PREFILL_KERNELS", (cpu_native.PREFILL_SOURCE,))


def attention_flops_per_prompt(mc, prompt_len: int) -> int:
    """Causal attention FLOPs (Q K^T and P V) of one prompt, every layer (sliding windows ignored)."""
    return 4 * mc.num_layers * mc.num_heads * mc.head_dim * prompt_len * (prompt_len + 1) // 2


def sized_engine(model: str, max_batch: int, prompt_len: int, context: int, **config) -> LLMEngine:
    """An engine with room for `max_batch` sequences of `prompt_len` / `context` tokens, no
    prefix cache (each run computes every token); `config`: other EngineConfig fields."""
    return LLMEngine(
        EngineConfig(
            model=model,
            cache=CacheConfig(
                num_blocks=max_batch * (max(prompt_len, context) + 96) // 16 + 64, enable_prefix_caching=False
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_batch,
                max_num_batched_tokens=max(prompt_len, max_batch * context),
                max_model_len=max(prompt_len, context) + 64,
            ),
            **config,
        ),
        show_progress=False,
    )


def _cpu_ceilings() -> tuple[float, float, float]:
    """This machine's matmul FLOP/s, memcpy B/s and read B/s, measured now."""
    return measure_matmul_gflops() * 1e9, measure_memcpy_gbps() * 1e9, measure_read_gbps() * 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pdserve bench-engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model folder (default: the embedded ~30M model)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--context", type=int, default=256, help="decode context length")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="each figure is the best of this many runs, as the ceilings are the best of theirs",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="token budget of a step, as a serving worker's: a batch's prompts are prefilled "
        "in steps of this many tokens (one 8k-token step runs at ~70%% of the speed of 2k ones)",
    )
    ap.add_argument(
        "--compare-tiled-prefill",
        action="store_true",
        help="also time each prefill row with the older tiled C attention kernel (same run, alternating; "
        "with --dtype bfloat16, which it refuses, that is torch's path: what ran before the flash kernel)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="leave glibc's mmap threshold as it is (serving workers raise it; this is the figure before they did)",
    )
    args = ap.parse_args(argv)
    if args.decode_steps < 1:
        ap.error("--decode-steps must be at least 1")
    if not args.glibc_malloc_defaults:
        configure_worker_process()  # as the workers are
    if args.threads:
        torch.set_num_threads(args.threads)
    from pdserve.modelgen.default_model import resolve_model

    batches = [int(b) for b in args.batches.split(",")]
    max_b = max(batches)
    engine = LLMEngine(
        EngineConfig(
            model=resolve_model(args.model),
            dtype=args.dtype,
            device=args.device,
            cache=CacheConfig(
                num_blocks=max_b * (max(args.prompt_len, args.context) + args.decode_steps + 64) // 16 + 64,
                # every figure computes every token: each repeat runs the same prompts again
                enable_prefix_caching=False,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_b,
                max_num_batched_tokens=max(args.max_num_batched_tokens, max_b),
                max_model_len=max(args.prompt_len, args.context) + args.decode_steps + 16,
            ),
        )
    )
    mc = engine.model_config
    with torch.device("meta"):  # the dense model's counts (CPU layouts may hold extra weight copies)
        dense = LlamaForCausalLM(mc, 16)
    # FLOPs per prompt token: the decoder layers (logits are computed only where a token is sampled)
    params = sum(p.numel() for n, p in dense.named_parameters() if not n.startswith(("embed_tokens", "lm_head")))
    # bytes a decode step reads: the layers and the LM head (the embedding lookup reads a few rows)
    weight_bytes = (params + mc.vocab_size * mc.hidden_size) * engine.dtype.itemsize
    kv_bytes_per_token = engine.kv_spec.bytes_per_block // engine.block_size
    if engine.device.type == "cuda":  # the device's own ceilings (copy counted read + write)
        from pdserve.bench.gpu_kernels import device_copy_gbps, matmul_tflops

        flops = matmul_tflops(dtype=engine.dtype) * 1e12
        memcpy = device_copy_gbps() / 2 * 1e9
        read = memcpy  # the device's copy rate, each byte counted once per direction
    else:  # measured again after the rows: the higher of the two (a shared host varies by 1.5x)
        flops, memcpy, read = _cpu_ceilings()
    if engine.device.type == "cuda":  # compile the Triton kernels before anything is timed
        bench_prefill(engine, max_b, args.prompt_len)
        bench_decode(engine, max_b, args.context, 2)
    rows = []
    for b in batches:
        t_pre = t_tiled = float("inf")
        for _ in range(args.repeats):  # alternating, so both see the same host
            t_pre = min(t_pre, bench_prefill(engine, b, args.prompt_len))
            if args.compare_tiled_prefill:
                with tiled_prefill_attention():
                    t_tiled = min(t_tiled, bench_prefill(engine, b, args.prompt_len))
        t_dec = min(bench_decode(engine, b, args.context, args.decode_steps) for _ in range(args.repeats))
        row = {
            "batch": b,
            "prefill_tokens_per_s": b * args.prompt_len / t_pre,
            "decode_tokens_per_s": b / t_dec,
            "decode_step_ms": t_dec * 1e3,
        }
        if args.compare_tiled_prefill:
            row["prefill_tokens_per_s_tiled"] = b * args.prompt_len / t_tiled
        rows.append(row)
        engine.pool.assert_all_free()
    if engine.device.type != "cuda":
        flops, memcpy, read = map(max, zip((flops, memcpy, read), _cpu_ceilings()))
    attn_per_token = attention_flops_per_prompt(mc, args.prompt_len) / args.prompt_len
    flops_per_token = 2 * params + attn_per_token  # what a prompt token costs, attention included
    for r in rows:  # against the ceilings as finally taken
        step_bytes = weight_bytes + r["batch"] * (args.context + args.decode_steps // 2) * kv_bytes_per_token
        r["prefill_mfu"] = 2 * params * r["prefill_tokens_per_s"] / flops
        r["prefill_mfu_with_attention"] = flops_per_token * r["prefill_tokens_per_s"] / flops
        if "prefill_tokens_per_s_tiled" in r:
            r["prefill_mfu_with_attention_tiled"] = flops_per_token * r["prefill_tokens_per_s_tiled"] / flops
        r["decode_bw_util"] = step_bytes / (r["decode_step_ms"] / 1e3) / read
    result = {
        "model": mc.path,
        "params_decoder_layers": params,
        "threads": torch.get_num_threads(),
        "matmul_gflops": flops / 1e9,
        "memcpy_gbps": memcpy / 1e9,
        "read_gbps": read / 1e9,
        "prompt_len": args.prompt_len,
        "prefill_attention_flop_share": attn_per_token / flops_per_token,
        "decode_context": args.context,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model {mc.path}: {params / 1e6:.1f}M decoder-layer params, {torch.get_num_threads()} threads")
    print(
        f"{engine.device}: matmul {flops / 1e9:.1f} GFLOP/s {engine.dtype}, read {read / 1e9:.2f} GB/s "
        f"(BW util against it), memcpy {memcpy / 1e9:.2f} GB/s (same run)"
    )
    print(
        f"prompts of {args.prompt_len} tokens: attention {attn_per_token / flops_per_token:.1%} of their FLOPs"
        + (" (tiled: the same rows with the older tiled C prefill attention)" if args.compare_tiled_prefill else "")
    )
    tiled_head = f" {'tiled tok/s':>12} {'MFU+attn':>8}" if args.compare_tiled_prefill else ""
    print(
        f"{'batch':>5} {'prefill tok/s':>14} {'MFU':>6} {'MFU+attn':>8}{tiled_head} "
        f"{'decode tok/s':>13} {'step ms':>8} {'BW util':>8}"
    )
    for r in rows:
        tiled = (
            f" {r['prefill_tokens_per_s_tiled']:>12.0f} {r['prefill_mfu_with_attention_tiled']:>8.1%}"
            if args.compare_tiled_prefill
            else ""
        )
        print(
            f"{r['batch']:>5} {r['prefill_tokens_per_s']:>14.0f} {r['prefill_mfu']:>6.1%} "
            f"{r['prefill_mfu_with_attention']:>8.1%}{tiled} "
            f"{r['decode_tokens_per_s']:>13.1f} {r['decode_step_ms']:>8.2f} {r['decode_bw_util']:>8.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
